"""Join the other processes of a job from the variables its launcher set; jax.distributed does the work.

Where the processes come from, first match wins:
1. JAX_COORDINATOR_ADDRESS=HOST:PORT, JAX_PROCESS_COUNT=N, JAX_PROCESS_INDEX=I (podtrain launch sets these);
2. torchrun style: MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK, or NODE_RANK * NPROC_PER_NODE + LOCAL_RANK;
3. whatever `jax.distributed.initialize()` detects by itself: SLURM, Open MPI, TPU pods, Kubernetes;
4. otherwise one process.
A half-set environment is an error, and joining has a deadline, so a job never hangs at start.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
from dataclasses import dataclass

import jax
from jax._src.distributed import global_state  # the client, for the watchdog; jax exposes no other handle

from podtrain.config.schema import DistributedConfig
from podtrain.errors import DistributedError, PeerLost, first_line
from podtrain.runtime import peers

JAX_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_PROCESS_COUNT", "JAX_PROCESS_INDEX")
TORCHRUN_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "NODE_RANK", "NPROC_PER_NODE")
# JAX's own deadline aborts the process from C++; ours fires first and exits with a message.
JAX_GRACE_S = 30
# What a collective says when another process's end closed its socket under gloo.
PEER_GONE = ("Connection reset by peer", "Connection closed by peer")


@dataclass(frozen=True)
class Processes:
    coordinator: str  # HOST:PORT of process 0
    count: int
    index: int
    source: str  # the variables that named them
    local_device_ids: tuple[int, ...] | None = None  # GPUs of this process, one per process under torchrun


def _int(environ, name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise DistributedError(f"{name}={environ[name]!r} is not an integer; set it to a whole number.") from None


def _check_address(address: str, source: str) -> str:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise DistributedError(
            f"The coordinator address {address!r} from {source} is not HOST:PORT; give the address "
            "of process 0, e.g. 10.0.0.1:1234."
        )
    return address


def _jax_processes(environ) -> Processes:
    missing = [name for name in JAX_VARS if not environ.get(name)]
    if missing:
        given = ", ".join(f"{name}={environ[name]}" for name in JAX_VARS if environ.get(name))
        raise DistributedError(
            f"{given} is set but {', '.join(missing)} is not. Set all three of JAX_COORDINATOR_ADDRESS=HOST:PORT "
            "(process 0), JAX_PROCESS_COUNT=N and JAX_PROCESS_INDEX=I (0..N-1), or none of them for a single process."
        )
    address = _check_address(environ["JAX_COORDINATOR_ADDRESS"], "JAX_COORDINATOR_ADDRESS")
    return Processes(
        address,
        _int(environ, "JAX_PROCESS_COUNT"),
        _int(environ, "JAX_PROCESS_INDEX"),
        "JAX_PROCESS_INDEX/JAX_PROCESS_COUNT",
    )


def _torchrun_processes(environ) -> Processes:
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE") if not environ.get(name)]
    per_node = (
        _int(environ, "LOCAL_WORLD_SIZE")
        if environ.get("LOCAL_WORLD_SIZE")
        else _int(environ, "NPROC_PER_NODE")
        if environ.get("NPROC_PER_NODE")
        else 1
    )
    local_rank = _int(environ, "LOCAL_RANK") if environ.get("LOCAL_RANK") else None
    if environ.get("RANK"):
        rank = _int(environ, "RANK")
    elif environ.get("NODE_RANK") and environ.get("NPROC_PER_NODE") and local_rank is not None:
        rank = _int(environ, "NODE_RANK") * per_node + local_rank
    else:
        missing.append("RANK (or NODE_RANK, NPROC_PER_NODE and LOCAL_RANK)")
    if missing:
        given = ", ".join(f"{name}={environ[name]}" for name in (*TORCHRUN_VARS, "LOCAL_RANK") if environ.get(name))
        raise DistributedError(
            f"{given} is set but {', '.join(missing)} is not. A torchrun-style launch needs MASTER_ADDR, MASTER_PORT, "
            "WORLD_SIZE and RANK (or NODE_RANK, NPROC_PER_NODE and LOCAL_RANK); or unset them all for a single process."
        )
    # torchrun's own agent listens on MASTER_PORT, so under torchrun the coordinator takes the next port.
    port = _int(environ, "MASTER_PORT") + (1 if environ.get("TORCHELASTIC_RUN_ID") else 0)
    local_ids = (local_rank,) if per_node > 1 and local_rank is not None else None
    return Processes(
        _check_address(f"{environ['MASTER_ADDR']}:{port}", "MASTER_ADDR/MASTER_PORT"),
        _int(environ, "WORLD_SIZE"),
        rank,
        "RANK/WORLD_SIZE",
        local_ids,
    )


def from_environment(environ=os.environ) -> Processes | None:
    """The processes the JAX_* or torchrun-style variables describe; None where neither is set."""
    if any(environ.get(name) for name in JAX_VARS):
        procs = _jax_processes(environ)
    elif any(environ.get(name) for name in TORCHRUN_VARS):
        procs = _torchrun_processes(environ)
    else:
        return None
    if procs.count < 1 or not 0 <= procs.index < procs.count:
        raise DistributedError(
            f"Process index {procs.index} is outside 0..{procs.count - 1} for a count of {procs.count} "
            f"({procs.source}); give each of the N processes its own index from 0 to N-1."
        )
    return procs


def _answers(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=2).close()
        return True
    except OSError:
        return False


def _why(procs: Processes) -> str:
    if procs.index == 0:
        return f"Process 0 hosts the coordinator and is still waiting for some of the other {procs.count - 1}."
    if _answers(procs.coordinator):
        return "The coordinator answers, so process 0 is up and another process has not joined."
    return "Nothing answers at that address: start process 0 there, or fix the address and port (and any firewall)."


@contextlib.contextmanager
def _deadline(seconds: int, procs: Processes | None):
    """Exit 2 with a message if joining takes longer than `seconds`.

    jax.distributed.initialize blocks in C++ and aborts the process at its own deadline, so a
    timer thread is the one way to stop it with a message: it names this process and what it tried.
    """

    def give_up():
        if procs is None:
            what = (
                "This process could not join the cluster that jax.distributed detected "
                "(SLURM, Open MPI, TPU pod or Kubernetes)"
            )
            why = "Check that every task of the job was started."
        else:
            what = (
                f"Process {procs.index} of {procs.count} ({procs.source}) could not join the "
                f"coordinator at {procs.coordinator}"
            )
            why = (
                f"{_why(procs)} Check that all {procs.count} processes were started with the same coordinator address "
                "and process count, each with its own index."
            )
        print(
            f"podtrain: error: {what} within {seconds} s (distributed.init_timeout). {why}", file=sys.stderr, flush=True
        )
        os._exit(DistributedError.exit_code)

    timer = threading.Timer(seconds, give_up)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


_joined: Processes | None = None  # jax.distributed joins once per process


def initialize(settings: DistributedConfig, environ=os.environ) -> Processes | None:
    """Join the job's other processes (before any JAX computation), and watch them: a lost one ends
    this process within seconds (podtrain.runtime.peers). Returns them, or None when alone."""
    global _joined
    if jax.distributed.is_initialized():
        return _joined
    timeout = settings.init_timeout
    service = {
        "initialization_timeout": timeout + JAX_GRACE_S,
        "heartbeat_timeout_seconds": settings.heartbeat_timeout,
        "shutdown_timeout_seconds": settings.shutdown_timeout,
    }
    jax.config.update("jax_enable_recoverability", True)  # a lost process is recorded, not fatal to the others
    procs = from_environment(environ)
    if procs is None:
        procs = _initialize_detected(timeout, service)
    elif procs.count > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        with _deadline(timeout, procs):
            jax.distributed.initialize(
                procs.coordinator, procs.count, procs.index, local_device_ids=procs.local_device_ids, **service
            )
    if procs is not None and procs.count > 1:
        peers.watch(
            global_state.client, procs.index, procs.count, settings.heartbeat_timeout, settings.shutdown_timeout
        )
    _joined = procs
    return procs


def _initialize_detected(timeout: int, service: dict) -> Processes | None:
    """Let jax.distributed detect a cluster (SLURM, Open MPI, TPU pod, Kubernetes); None if it finds none."""
    try:
        with _deadline(timeout, None):
            jax.distributed.initialize(**service)
    except ValueError as e:
        if "coordinator_address" in str(e):  # no cluster environment found
            return None
        raise DistributedError(f"jax.distributed detected a cluster but could not start from it: {e}") from None
    except RuntimeError:  # JAX already runs in this process, which makes it a single process
        return None
    return Processes(
        "the coordinator jax.distributed detected",
        jax.process_count(),
        jax.process_index(),
        "detected by jax.distributed",
    )


@contextlib.contextmanager
def peer_loss_in_one_line():
    """A collective that fails because another process of the job died ends this process with one
    paragraph instead of JAX's traceback: the watchdog's, which names the process lost."""
    try:
        yield
    except Exception as e:  # JAX's runtime error in a step, a ValueError in orbax's barrier
        if jax.process_count() == 1 or not any(words in str(e) for words in PEER_GONE):
            raise
        peers.await_verdict()  # the watchdog names the lost process and ends this one
        raise PeerLost(
            f"process {jax.process_index()} of {jax.process_count()} lost another process of the job "
            f"({first_line(e, 160)}). Rerun the job to resume from its newest checkpoint, or launch "
            "it with `podtrain launch --max-restarts N` to have that done for you."
        ) from None
