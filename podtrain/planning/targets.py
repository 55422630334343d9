"""The devices of a hardware target to plan a job for: the real chip's, with no chip present.

A TPU target (`v4-32`, `v5e-8`, `v6e-8`, ...): with libtpu installed (the `tpu` extra) XLA
compiles for a TPU topology. A GPU target (`h100`, `h100x8`, `a100x8`, `h200`): XLA's GPU compiler,
from JAX's CUDA plugin, compiles for a description of the card (`gpus.py`) with no GPU and no
CUDA library. `cpu:N` is this machine's CPU split into N fake host devices.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from dataclasses import dataclass

import jax
import numpy as np

from podtrain.errors import ConfigError, DeviceError, first_line
from podtrain.planning import gpus
from podtrain.runtime.chips import CHIPS, Chip, GiB, host_memory

TPU_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e"}


@dataclass
class Target:
    name: str
    platform: str  # what the job would run on: tpu, gpu or cpu (sets `auto` precision)
    chip: Chip
    devices: list  # the devices to compile for: the TPU's or GPU's topology's, or fake host devices
    slices: int = 1  # TPU slices, or GPU hosts, joined by the data-centre network

    @property
    def label(self) -> str:
        many = f"{self.slices} {'slices' if self.platform == 'tpu' else 'hosts'} of " if self.slices > 1 else ""
        return (
            f"{self.name}: {many}{len(self.devices) // self.slices} x {self.chip.name}, "
            f"{self.chip.memory / GiB:.2f} GiB each (compiled for the {self.platform.upper()})"
        )


def _doubled(dims: list[int], times: int) -> list[int]:
    """A real slice's shape: double the last axis below the largest (2x2x1 -> 2x2x2 -> 2x2x4 -> 2x4x4 -> 4x4x4)."""
    for _ in range(times):
        short = [i for i, d in enumerate(dims) if d < max(dims)]
        dims[short[-1] if short else -1] *= 2
    return dims


def _topology(generation: str, chips: int) -> list[int]:
    steps = int(math.log2(chips))
    if CHIPS[generation].tpu.torus == 2:
        return _doubled([1, 1], steps)
    return _doubled([2, 2, 1], steps - 2) if chips >= 4 else _doubled([1, 1, 1], steps)


def tpu_target(name: str, generation: str, cores: int, slices: int = 1) -> Target:
    slices_of = CHIPS[generation].tpu
    chips = cores // slices_of.cores_per_chip
    if chips < 1 or chips & (chips - 1):
        raise ConfigError(
            f"--target {name}: a {generation} slice has a power-of-two number of chips; e.g. "
            f"{generation}-{8 * slices_of.cores_per_chip}."
        )
    dims = _topology(generation, chips)
    options = {"chip_config_name": "megacore"} if slices_of.megacore else {}
    if chips < 4:  # smaller than one host's 2x2 chips
        options["chips_per_host_bounds"] = (*dims, 1)[:3]
    # Compiling claims no TPU: let several plans (and a TPU job's own processes) load libtpu at once.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    # Off a TPU VM, libtpu looks for the slice it runs on and prints a screen of warnings when it
    # finds none: tell it the target's, and keep its logging to errors (a TPU VM's own settings win).
    for name_, value in {
        "TPU_ACCELERATOR_TYPE": name, "TPU_WORKER_HOSTNAMES": "localhost", "TPU_WORKER_ID": "0",
        "TPU_SKIP_MDS_QUERY": "1", "TPU_MIN_LOG_LEVEL": "3", "TPU_STDERR_LOG_LEVEL": "3",
    }.items():  # fmt: skip
        os.environ.setdefault(name_, value)
    try:
        from jax.experimental import topologies

        topology = topologies.get_topology_desc(
            platform="tpu", topology_name=f"{generation}:{'x'.join(map(str, dims))}", num_slices=slices, **options
        )
    except Exception as e:  # no libtpu, or a topology it does not know
        raise DeviceError(
            f"--target {name} compiles for the TPU through libtpu, which could not describe a "
            f"{generation} {'x'.join(map(str, dims))} slice here "
            f"({first_line(e, 1000)}). "
            "Install the tpu extra: `pip install -e '.[tpu]'`."
        ) from None
    return Target(name, "tpu", CHIPS[generation], list(topology.devices), slices)


def measured_cpu(devices: int) -> Chip:
    """This machine's CPU shared by `devices` fake devices, its speed measured now: a float32
    matmul for FLOP/s and an array copy for memory bandwidth."""
    matmul = jax.jit(lambda a: a @ a)
    copy = jax.jit(lambda a: a + 1)
    a, b = np.ones((1024, 1024), np.float32), np.ones(2**25, np.float32)
    rates = []
    for fn, x, amount in ((matmul, a, 2 * 1024**3), (copy, b, 2 * b.nbytes)):
        x = jax.device_put(x, jax.devices("cpu")[0])
        fn(x).block_until_ready()
        clock = time.perf_counter()
        for _ in range(5):
            fn(x).block_until_ready()
        rates.append(5 * amount / (time.perf_counter() - clock) / devices)
    return Chip("CPU (this machine, measured)", "cpu", host_memory() / devices, rates[0], rates[1], rates[1])


def fake_devices(name: str, count: int) -> list:
    have = jax.devices("cpu")
    if count > len(have):
        raise ConfigError(
            f"--target {name} needs {count} fake CPU devices and this process has {len(have)}: run `podtrain plan` "
            f"(it sets jax_num_cpu_devices={count} itself), or set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={count} before JAX starts."
        )
    return have[:count]


def cpu_count(name: str) -> int | None:
    """How many host devices a `cpu:N` target needs (the CLI sets jax_num_cpu_devices from it
    before JAX starts); None for other targets."""
    cpu = re.fullmatch(r"cpu:(\d+)", name)
    return int(cpu.group(1)) if cpu else None


def target(name: str) -> Target:
    """The devices and chip of `--target NAME`; `NxNAME` is N of them joined by the data-centre
    network (TPU slices, GPU hosts)."""
    name = name.strip().lower()
    many = re.fullmatch(r"(\d+)x([a-z].*)", name)
    slices, one = (int(many.group(1)), many.group(2)) if many else (1, name)
    tpus = [generation for generation, chip in CHIPS.items() if chip.tpu]
    tpu = re.fullmatch(rf"({'|'.join([*tpus, *TPU_ALIASES])})-(\d+)", one)
    if tpu and slices >= 1:
        generation = TPU_ALIASES.get(tpu.group(1), tpu.group(1))
        return dataclasses.replace(tpu_target(one, generation, int(tpu.group(2)), slices), name=name)
    gpu = re.fullmatch(rf"({'|'.join(gpus.CARDS)})(?:x(\d+))?", one)
    count = int(gpu.group(2) or 1) if gpu else cpu_count(name)
    if not count:
        raise ConfigError(
            f"Unknown --target {name!r}. Use a TPU slice ({', '.join(f'{t}-8' for t in tpus)}, ...), a GPU box "
            f"({', '.join(gpus.CARDS)}, or N of one: h100x8), N of either joined by the network (2xv5e-256, "
            "2xh100x8), or cpu:N."
        )
    if gpu and slices >= 1:
        devices = gpus.devices(gpu.group(1), count, slices)
        return Target(name, "gpu", gpus.chip(gpu.group(1)), devices, slices)
    if slices != 1:
        raise ConfigError(f"--target {name}: cpu:N is one machine; give N x TPU slices or GPU hosts.")
    return Target(name, "cpu", measured_cpu(count), fake_devices(name, count))
