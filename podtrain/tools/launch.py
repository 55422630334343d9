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
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from podtrain import storage
from podtrain.errors import ConfigError, PodtrainError, Preempted
from podtrain.tools.slots import Slots, child_env, free_port, gpus_per_process, slot_env

STOP_GRACE_S = 5
CHECK_EVERY_S = 2  # between slot checks while the job runs short of slots
SURVIVORS_S = 60  # for a training job's survivors of a loss to write the state they hold and exit


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


@dataclass
class Launch:
    """`argv` as processes node_rank * nproc ... node_rank * nproc + nproc - 1 of nnodes * nproc,
    restarted up to max_restarts times, on as few as min_nproc of the slots (see the module's
    docstring; `checkpoint_dir`, where known, names the step a restart resumes from; with
    `survivors_save` the others are given time to write what they hold after a loss). Each
    process's output goes to `log_dir`, by default RUN_DIR/logs of a local run and runs/launch
    otherwise (a log grows line by line, which an object in a bucket cannot)."""

    argv: list[str]
    log_dir: str | None
    nproc: int
    devices_per_proc: int | None = None
    nnodes: int = 1
    node_rank: int = 0
    coordinator: str | None = None
    max_restarts: int = 0
    checkpoint_dir: str | None = None
    run_dir: str | None = None
    min_nproc: int | None = None
    slot_check: str | None = None
    rejoin_timeout: float = 60
    survivors_save: bool = False
    processes: list[_Process] = field(default_factory=list)  # the running attempt's
    asked: list[int] = field(default_factory=list)  # the signals that asked the job to stop

    def __post_init__(self):
        self.min_nproc = self.nproc if self.min_nproc is None else self.min_nproc
        self.check()
        self.gpus = gpus_per_process(self.nproc, self.devices_per_proc)
        local_run = self.run_dir and not storage.is_remote(self.run_dir)
        self.log_dir = Path(self.log_dir or (Path(self.run_dir) / "logs" if local_run else "runs/launch"))
        self.base, self.lock = dict(os.environ), threading.Lock()
        self.slots = Slots(
            self.nproc, self.slot_check, lambda slot: slot_env(self.base, slot, self.devices_per_proc, self.gpus)
        )
        self.running = list(range(self.nproc))

    def check(self) -> None:
        n, nodes, rank, restarts, least = self.nproc, self.nnodes, self.node_rank, self.max_restarts, self.min_nproc
        if n < 1 or nodes < 1 or not 0 <= rank < nodes or restarts < 0 or not 1 <= least <= n:
            raise ConfigError(
                f"--nproc={n}, --nnodes={nodes}, --node-rank={rank}, --max-restarts={restarts}, "
                f"--min-nproc={least}: need nproc >= 1, nnodes >= 1, 0 <= node-rank < nnodes, max-restarts >= 0 "
                "and 1 <= min-nproc <= nproc."
            )
        if nodes > 1 and not self.coordinator:
            raise ConfigError(
                "A launch over several nodes needs --coordinator HOST:PORT, an address of node 0 that every node "
                "can reach (or MASTER_ADDR and MASTER_PORT)."
            )
        if nodes > 1 and least < n:
            raise ConfigError(
                "--min-nproc shrinks a job on one node; across nodes, let the scheduler restart the job on the "
                "hosts it has (docs/multihost.md shows how)."
            )

    def run(self) -> int:
        """0 when all succeed, 75 when they stopped on request, else the exit status of the first to fail."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        print(
            f"[launch] {self.nproc} of {self.nnodes * self.nproc} processes on this node, logs in {self.log_dir}/",
            flush=True,
        )
        signal.signal(signal.SIGTERM, self.forward)
        signal.signal(signal.SIGINT, self.forward)
        attempt, restart = 0, 0
        try:
            while True:
                self.start(attempt)
                failed = _wait(self.processes, self.back if len(self.running) < self.nproc else None)
                codes = [p.popen.returncode for p in self.processes]
                if (
                    failed is None
                    and len(self.running) < self.nproc
                    and Preempted.exit_code in codes
                    and not self.asked
                ):
                    self.processes.clear()  # saved and stopped to grow
                    self.running, attempt = self.slots.gather(0), attempt + 1
                    say(f"restarting the job on {len(self.running)} processes from {resume_point(self.checkpoint_dir)}")
                    continue
                if failed is None:  # all done, or all stopped after saving at the same step
                    return Preempted.exit_code if Preempted.exit_code in codes else 0
                if (code := self.after_failure(failed, restart)) is not None:
                    return code
                restart, attempt = restart + 1, attempt + 1
                say(
                    f"restarting the job on {len(self.running)} processes from {resume_point(self.checkpoint_dir)} "
                    f"(restart {restart} of {self.max_restarts}, {self.max_restarts - restart} left)"
                )
        finally:
            _stop(self.processes)

    def start(self, attempt: int) -> None:
        """The attempt's processes, one per running slot, on a fresh coordinator port (the old one may linger)."""
        address = self.coordinator or f"127.0.0.1:{free_port()}"
        count = self.nnodes * len(self.running)  # fewer than nproc only on one node
        for index, slot in enumerate(self.running):
            rank = self.node_rank * self.nproc + index
            env = child_env(self.base, address, count, rank, slot, self.devices_per_proc, self.gpus, attempt)
            log = self.log_dir / f"process_{rank}.log"
            self.processes.append(_Process(self.argv, env, rank, log, self.lock, attempt > 0))
            print(f"[launch] process {rank}: pid {self.processes[-1].popen.pid}, coordinator {address}", flush=True)

    def after_failure(self, failed: _Process, restart: int) -> int | None:
        """The launch's exit status where a failure ends it, else None, the job stopped and its slots
        gathered for the next attempt."""
        code, left = failed.popen.returncode, self.max_restarts - restart
        status = code if code > 0 else 128 - code
        if code == PodtrainError.exit_code or self.asked or not left:
            spent = "; no restart left" if self.max_restarts and not left else ""
            say(f"process {failed.rank} ended with {_exit_status(code)}{spent}; stopping the other processes")
            return status
        deadline = time.monotonic() + (SURVIVORS_S if self.survivors_save else 0)
        while time.monotonic() < deadline and any(p.popen.poll() is None for p in self.processes):
            time.sleep(0.1)
        _stop(self.processes, grace=0)  # the others cannot finish a step without it
        self.processes.clear()
        say(f"process {failed.rank} ended with {_exit_status(code)}")
        if self.min_nproc < self.nproc:
            self.running = self.slots.gather(self.rejoin_timeout)
            if len(self.running) < self.min_nproc:
                say(
                    f"{len(self.running)} of {self.nproc} slots can run a process after {self.rejoin_timeout:g} s, "
                    f"fewer than --min-nproc={self.min_nproc}; giving up"
                )
                return status
        return None

    def forward(self, signum, _frame) -> None:
        """SIGTERM or SIGINT to the launch: the processes save and stop together; asked again, they are stopped now."""
        if self.asked:
            sys.exit(128 + signum)
        self.asked.append(signum)
        say(f"{signal.Signals(signum).name}: asking the processes to save and stop (again to stop them at once)")
        for p in self.processes:
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)

    def back(self) -> bool:
        """Whether a slot the job runs without can run a process again (then the job saves and grows)."""
        returned = [slot for slot in range(self.nproc) if slot not in self.running and self.slots.ready(slot)]
        if returned:
            say(f"slot {', '.join(map(str, returned))} can run a process again; the job saves and grows")
        return bool(returned)


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
