"""`podtrain launch`: the processes of one job on this machine, with the variables that join them.

Each process gets JAX_COORDINATOR_ADDRESS, JAX_PROCESS_COUNT and JAX_PROCESS_INDEX, and its share
of the devices: K fake CPU devices, or K GPUs through CUDA_VISIBLE_DEVICES. Output is streamed with
a rank prefix and written to one log file per process. The launch fails fast: when one process
exits with an error, the others are stopped and the launch exits non-zero, since the survivors
would otherwise wait for it in their next collective. A process that stops after saving on
SIGTERM (errors.Preempted) is not a failure: the others are saving at the same step.

With max_restarts N, a job one of whose processes died (a signal) or failed with an error a rerun
can fix is killed whole and started again, up to N times, on a fresh coordinator port: training
resumes from the newest intact checkpoint by itself. A user error (exit 2) is not restarted, nor a
stop on request (75), which is passed on. Each process of the k-th restart gets PODTRAIN_RESTART=k
(training records the restarts and the steps they recompute in metrics.jsonl).

Elastic, with min_nproc M < N: each of the N slots (a process's place: its GPUs, or its fake CPU
devices) may be checked by a command (`--slot-check`, run with PODTRAIN_SLOT and the slot's
CUDA_VISIBLE_DEVICES; exit 0 when the slot can run a process). After a loss the job restarts on
the slots that pass within `--rejoin-timeout` seconds, as long as there are at least M; while it
runs on fewer than N, a slot that passes again makes the job save and stop (as on SIGTERM) and
start again on N. Training keeps its global batch on any count (train.grad_accum adapts).
"""

from __future__ import annotations

import argparse
import glob
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from podtrain import storage
from podtrain.errors import ConfigError, PodtrainError, Preempted

STOP_GRACE_S = 5
CHECK_EVERY_S = 2  # between slot checks while the job runs short of slots
SURVIVORS_S = 60  # for a training job's survivors of a loss to write the state they hold and exit


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


def slot_env(base: dict, slot: int, devices_per_proc: int | None, gpus: int) -> dict:
    """`base` with the devices of a slot: K fake CPU devices, or its GPUs."""
    env = dict(base)
    if devices_per_proc:
        # Only JAX's CPU platform reads the fake device count, so it is harmless on GPU and TPU hosts.
        env["XLA_FLAGS"] = (
            f"{base.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices_per_proc}".strip()
        )
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(slot * gpus + i) for i in range(gpus))
    return env


def child_env(
    base: dict,
    coordinator: str,
    count: int,
    rank: int,
    slot: int,
    devices_per_proc: int | None,
    gpus: int,
    restart: int = 0,
) -> dict:
    return {
        **slot_env(base, slot, devices_per_proc, gpus),
        "JAX_COORDINATOR_ADDRESS": coordinator,
        "JAX_PROCESS_COUNT": str(count),
        "JAX_PROCESS_INDEX": str(rank),
        "PODTRAIN_RESTART": str(restart),
        "PYTHONUNBUFFERED": "1",
    }


def _exit_status(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def resume_point(checkpoint_dir: str | None) -> str:
    """Where a restarted training job resumes: its newest complete checkpoint (orbax gives a step
    its number only once it is complete; one found damaged on resume is skipped by training)."""
    if not checkpoint_dir:
        return "its newest checkpoint"
    folder = storage.path(checkpoint_dir)
    steps = [int(p.name) for p in folder.iterdir() if p.name.isdigit()] if folder.is_dir() else []
    return f"step {max(steps)}, its newest checkpoint" if steps else "step 0 (no checkpoint yet)"


class Slots:
    """The N places of this node's processes, and which of them can run one now."""

    def __init__(self, n: int, check: str | None, env_of):
        self.n, self.check, self.env_of = n, check, env_of

    def ready(self, slot: int) -> bool:
        if not self.check:
            return True
        env = {**self.env_of(slot), "PODTRAIN_SLOT": str(slot)}
        try:
            return subprocess.run(self.check, shell=True, env=env, capture_output=True, timeout=30).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def gather(self, timeout: float) -> list[int]:
        """The slots ready once all are, or those ready after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            ready = [slot for slot in range(self.n) if self.ready(slot)]
            if len(ready) == self.n or time.monotonic() > deadline:
                return ready
            time.sleep(1)


class _Process:
    """One child, its output streamed with a `[rank]` prefix to stdout and to its log file."""

    def __init__(self, argv: list[str], env: dict, rank: int, log_path: Path, lock: threading.Lock, append: bool):
        self.rank = rank
        self.popen = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.reader = threading.Thread(target=self._stream, args=(log_path, lock, append), daemon=True)
        self.reader.start()

    def _stream(self, log_path: Path, lock: threading.Lock, append: bool) -> None:
        with open(log_path, "ab" if append else "wb") as log:  # a restart's output follows the crash's
            for line in self.popen.stdout:
                log.write(line)
                log.flush()
                with lock:
                    sys.stdout.write(f"[{self.rank}] {line.decode(errors='replace')}")
                    sys.stdout.flush()


def _stop(processes: list[_Process], grace: float = STOP_GRACE_S) -> None:
    """Terminate the processes still alive, killed after `grace` seconds (at once with none)."""
    alive = [p.popen for p in processes if p.popen.poll() is None]
    for p in alive:
        p.terminate() if grace else p.kill()
    deadline = time.monotonic() + grace
    for p in alive:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for p in processes:
        p.reader.join(timeout=STOP_GRACE_S)


def _wait(processes: list[_Process], grow=None) -> _Process | None:
    """The first process to fail, or None once all have succeeded or stopped on request. Of those
    found failed at once, one killed by a signal is taken first: the others' errors follow from it.
    `grow() -> bool`, asked every few seconds: True asks the processes to save and stop."""
    check = time.monotonic() + CHECK_EVERY_S
    while True:
        codes = [p.popen.poll() for p in processes]
        failed = [p for p, code in zip(processes, codes) if code not in (None, 0, Preempted.exit_code)]
        if failed or None not in codes:
            return min(failed, key=lambda p: p.popen.returncode >= 0, default=None)
        if grow is not None and time.monotonic() > check:
            check = time.monotonic() + CHECK_EVERY_S
            if grow():
                grow = None
                for p in processes:
                    p.popen.send_signal(signal.SIGTERM)
        time.sleep(0.1)


def launch(
    argv: list[str],
    log_dir: str | None,
    nproc: int,
    devices_per_proc: int | None = None,
    nnodes: int = 1,
    node_rank: int = 0,
    coordinator: str | None = None,
    max_restarts: int = 0,
    checkpoint_dir: str | None = None,
    run_dir: str | None = None,
    min_nproc: int | None = None,
    slot_check: str | None = None,
    rejoin_timeout: float = 60,
    survivors_save: bool = False,
) -> int:
    """Run `argv` as processes node_rank * nproc ... node_rank * nproc + nproc - 1 of nnodes * nproc,
    restarting the job up to max_restarts times, on as few as min_nproc of the slots (see the
    module's docstring; `checkpoint_dir`, where known, names the step a restart resumes from; with
    `survivors_save` the others are given time to write what they hold after a loss). Each
    process's output goes to `log_dir`, by default RUN_DIR/logs of a local run and runs/launch
    otherwise (a log grows line by line, which an object in a bucket cannot). Returns 0 when all
    succeed, 75 when they stopped on request, else the exit status of the first to fail."""
    min_nproc = nproc if min_nproc is None else min_nproc
    if nproc < 1 or nnodes < 1 or not 0 <= node_rank < nnodes or max_restarts < 0 or not 1 <= min_nproc <= nproc:
        raise ConfigError(
            f"--nproc={nproc}, --nnodes={nnodes}, --node-rank={node_rank}, --max-restarts={max_restarts}, "
            f"--min-nproc={min_nproc}: need nproc >= 1, nnodes >= 1, 0 <= node-rank < nnodes, max-restarts >= 0 "
            "and 1 <= min-nproc <= nproc."
        )
    if nnodes > 1 and not coordinator:
        raise ConfigError(
            "A launch over several nodes needs --coordinator HOST:PORT, an address of node 0 that every node can "
            "reach (or MASTER_ADDR and MASTER_PORT)."
        )
    if nnodes > 1 and min_nproc < nproc:
        raise ConfigError(
            "--min-nproc shrinks a job on one node; across nodes, let the scheduler restart the job on the hosts "
            "it has (docs/multihost.md shows how)."
        )
    gpus = gpus_per_process(nproc, devices_per_proc)
    local_run = run_dir and not storage.is_remote(run_dir)
    log_dir = Path(log_dir or (Path(run_dir) / "logs" if local_run else "runs/launch"))
    log_dir.mkdir(parents=True, exist_ok=True)
    base, lock = dict(os.environ), threading.Lock()
    slots = Slots(nproc, slot_check, lambda slot: slot_env(base, slot, devices_per_proc, gpus))
    print(f"[launch] {nproc} of {nnodes * nproc} processes on this node, logs in {log_dir}/", flush=True)
    processes: list[_Process] = []  # the running attempt's
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

    def back() -> bool:
        returned = [slot for slot in range(nproc) if slot not in running and slots.ready(slot)]
        if returned:
            say(f"slot {', '.join(map(str, returned))} can run a process again; the job saves and grows")
        return bool(returned)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    running, attempt, restart = list(range(nproc)), 0, 0
    try:
        while True:
            address = coordinator or f"127.0.0.1:{free_port()}"  # a fresh port: the old one may linger
            count = nnodes * len(running)  # fewer than nproc only on one node
            for index, slot in enumerate(running):
                rank = node_rank * nproc + index
                env = child_env(base, address, count, rank, slot, devices_per_proc, gpus, attempt)
                processes.append(_Process(argv, env, rank, log_dir / f"process_{rank}.log", lock, attempt > 0))
                print(f"[launch] process {rank}: pid {processes[-1].popen.pid}, coordinator {address}", flush=True)
            failed = _wait(processes, back if len(running) < nproc else None)
            codes = [p.popen.returncode for p in processes]
            if failed is None and len(running) < nproc and Preempted.exit_code in codes and not asked:
                processes.clear()  # saved and stopped to grow
                running, attempt = slots.gather(0), attempt + 1
                say(f"restarting the job on {len(running)} processes from {resume_point(checkpoint_dir)}")
                continue
            if failed is None:  # all done, or all stopped after saving at the same step
                return Preempted.exit_code if Preempted.exit_code in codes else 0
            code, left = failed.popen.returncode, max_restarts - restart
            if code == PodtrainError.exit_code or asked or not left:
                spent = "; no restart left" if max_restarts and not left else ""
                say(f"process {failed.rank} ended with {_exit_status(code)}{spent}; stopping the other processes")
                return code if code > 0 else 128 - code
            deadline = time.monotonic() + (SURVIVORS_S if survivors_save else 0)
            while time.monotonic() < deadline and any(p.popen.poll() is None for p in processes):
                time.sleep(0.1)
            _stop(processes, grace=0)  # the others cannot finish a step without it
            processes.clear()
            say(f"process {failed.rank} ended with {_exit_status(code)}")
            if min_nproc < nproc:
                running = slots.gather(rejoin_timeout)
                if len(running) < min_nproc:
                    say(
                        f"{len(running)} of {nproc} slots can run a process after {rejoin_timeout:g} s, fewer than "
                        f"--min-nproc={min_nproc}; giving up"
                    )
                    return code if code > 0 else 128 - code
            restart, attempt = restart + 1, attempt + 1
            say(
                f"restarting the job on {len(running)} processes from {resume_point(checkpoint_dir)} "
                f"(restart {restart} of {max_restarts}, {left - 1} left)"
            )
    finally:
        _stop(processes)


def say(line: str) -> None:
    print(f"[launch] {line}", file=sys.stderr, flush=True)


def add_launch_command(sub, run) -> None:
    """The `launch` subcommand on the CLI's subparsers; `run(args)` launches."""
    la = sub.add_parser(
        "launch",
        help="run a command as several processes of one job on this machine",
        description=(
            "Start N processes of COMMAND (a podtrain command such as `train CONFIG key=value`, or any program) with "
            "the variables that join them; stream their output with a rank prefix; stop them all if one fails (and "
            "restart, with --max-restarts, on the slots left with --min-nproc)."
        ),
    )
    la.add_argument("--nproc", type=int, required=True, help="processes on this node")
    la.add_argument(
        "--devices-per-proc",
        type=int,
        help="fake CPU devices per process on CPU; GPUs per process on a GPU node (default: an equal share)",
    )
    la.add_argument("--nnodes", type=int, default=1, help="nodes in the job (each runs its own launch)")
    la.add_argument("--node-rank", type=int, default=0, help="this node's index, 0..nnodes-1")
    la.add_argument("--coordinator", help="HOST:PORT of node 0 (default: 127.0.0.1 and a free port, for one node)")
    la.add_argument("--log-dir", help="where process_<rank>.log go (default: RUN_DIR/logs for train, else runs/launch)")
    la.add_argument("--max-restarts", type=int, default=0, metavar="N", help="restarts after a failure (not exit 2/75)")
    la.add_argument("--min-nproc", type=int, metavar="M", help="restart on as few as M processes (default: nproc)")
    la.add_argument(
        "--slot-check",
        metavar="CMD",
        help="shell command, exit 0 when slot $PODTRAIN_SLOT (its CUDA_VISIBLE_DEVICES) can run a process",
    )
    la.add_argument(
        "--rejoin-timeout", type=float, default=60, metavar="S", help="seconds a lost slot has to come back"
    )
    la.add_argument(
        "command_line", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="the command each process runs"
    )
    la.set_defaults(func=run)
