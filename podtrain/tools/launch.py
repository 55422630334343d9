"""`podtrain launch`: the processes of one job on this machine, with the variables that join them.

Each process gets JAX_COORDINATOR_ADDRESS, JAX_PROCESS_COUNT and JAX_PROCESS_INDEX, and its share
of the devices: K fake CPU devices, or K GPUs through CUDA_VISIBLE_DEVICES. Output is streamed with
a rank prefix and written to one log file per process. The launch fails fast: when one process
exits with an error, the others are stopped and the launch exits non-zero, since the survivors
would otherwise wait for it in their next collective. A process that stops after saving on
SIGTERM (errors.Preempted) is not a failure: the others are saving at the same step.
"""

from __future__ import annotations

import glob
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from podtrain.errors import ConfigError, Preempted

STOP_GRACE_S = 5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpus_per_process(nproc: int, devices_per_proc: int | None) -> int:
    """GPUs each local process gets; 0 on a machine without GPUs."""
    gpus = len(glob.glob("/dev/nvidia[0-9]*"))
    if not gpus:
        return 0
    per_proc = devices_per_proc or gpus // nproc
    if per_proc < 1 or per_proc * nproc > gpus:
        raise ConfigError(
            f"{nproc} processes x {devices_per_proc or per_proc} GPUs do not fit the {gpus} GPUs of this machine; "
            "lower --nproc or --devices-per-proc."
        )
    return per_proc


def child_env(
    base: dict, coordinator: str, count: int, rank: int, local_rank: int, devices_per_proc: int | None, gpus: int
) -> dict:
    env = {
        **base,
        "JAX_COORDINATOR_ADDRESS": coordinator,
        "JAX_PROCESS_COUNT": str(count),
        "JAX_PROCESS_INDEX": str(rank),
        "PYTHONUNBUFFERED": "1",
    }
    if devices_per_proc:
        # Only JAX's CPU platform reads the fake device count, so it is harmless on GPU and TPU hosts.
        env["XLA_FLAGS"] = (
            f"{base.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices_per_proc}".strip()
        )
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(local_rank * gpus + i) for i in range(gpus))
    return env


def _exit_status(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


class _Process:
    """One child, its output streamed with a `[rank]` prefix to stdout and to its log file."""

    def __init__(self, argv: list[str], env: dict, rank: int, log_path: Path, lock: threading.Lock):
        self.rank = rank
        self.popen = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.reader = threading.Thread(target=self._stream, args=(log_path, lock), daemon=True)
        self.reader.start()

    def _stream(self, log_path: Path, lock: threading.Lock) -> None:
        with open(log_path, "wb") as log:
            for line in self.popen.stdout:
                log.write(line)
                log.flush()
                with lock:
                    sys.stdout.write(f"[{self.rank}] {line.decode(errors='replace')}")
                    sys.stdout.flush()


def _stop(processes: list[_Process]) -> None:
    alive = [p.popen for p in processes if p.popen.poll() is None]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for p in alive:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def launch(
    argv: list[str],
    nproc: int,
    log_dir: Path,
    devices_per_proc: int | None = None,
    nnodes: int = 1,
    node_rank: int = 0,
    coordinator: str | None = None,
) -> int:
    """Run `argv` as processes node_rank * nproc ... node_rank * nproc + nproc - 1 of nnodes * nproc.
    Returns 0 when all succeed, else the exit status of the first to fail."""
    if nproc < 1 or nnodes < 1 or not 0 <= node_rank < nnodes:
        raise ConfigError(
            f"--nproc={nproc}, --nnodes={nnodes}, --node-rank={node_rank}: "
            "need nproc >= 1, nnodes >= 1 and 0 <= node-rank < nnodes."
        )
    if nnodes > 1 and not coordinator:
        raise ConfigError(
            "A launch over several nodes needs --coordinator HOST:PORT, an address of node 0 that every node can "
            "reach (or MASTER_ADDR and MASTER_PORT)."
        )
    coordinator = coordinator or f"127.0.0.1:{free_port()}"
    gpus = gpus_per_process(nproc, devices_per_proc)
    log_dir.mkdir(parents=True, exist_ok=True)
    count, base, lock = nnodes * nproc, dict(os.environ), threading.Lock()
    print(
        f"[launch] {nproc} of {count} processes on this node, coordinator {coordinator}, logs in {log_dir}/", flush=True
    )
    processes: list[_Process] = []
    asked: list[int] = []

    def forward(signum, _frame):
        """SIGTERM or SIGINT to the launch: the processes save and stop together; asked again, they are stopped now."""
        if asked:
            sys.exit(128 + signum)
        asked.append(signum)
        print(
            f"[launch] {signal.Signals(signum).name}: asking the processes to save and "
            "stop (again to stop them at once)",
            file=sys.stderr,
            flush=True,
        )
        for p in processes:
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    try:
        for local_rank in range(nproc):
            rank = node_rank * nproc + local_rank
            env = child_env(base, coordinator, count, rank, local_rank, devices_per_proc, gpus)
            processes.append(_Process(argv, env, rank, log_dir / f"process_{rank}.log", lock))
            print(f"[launch] process {rank}: pid {processes[-1].popen.pid}", flush=True)
        while True:
            codes = [p.popen.poll() for p in processes]
            failed = next((p for p, code in zip(processes, codes) if code not in (None, 0, Preempted.exit_code)), None)
            if failed:
                code = failed.popen.returncode
                print(
                    f"[launch] process {failed.rank} ended with {_exit_status(code)}; stopping the other processes",
                    file=sys.stderr,
                    flush=True,
                )
                return code if code > 0 else 128 - code
            if None not in codes:  # all done, or all stopped after saving at the same step
                return Preempted.exit_code if Preempted.exit_code in codes else 0
            time.sleep(0.1)
    finally:
        _stop(processes)
        for p in processes:
            p.reader.join(timeout=STOP_GRACE_S)
