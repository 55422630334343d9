"""Where a launched process runs (`podtrain launch`): a free coordinator port, its share of the
devices (K fake CPU devices, or its GPUs through CUDA_VISIBLE_DEVICES), the variables that join it
to the job, and which of the node's slots can run one now."""

from __future__ import annotations

import glob
import socket
import subprocess
import time

from podtrain.errors import ConfigError


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
