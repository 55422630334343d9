"""Whether a job fits its devices' memory, and the smallest usual change that makes it fit.

XLA answers: the train step compiled ahead of time for the devices, its `memory_analysis()` per
device against what one device holds. The TPU compiler refuses a program that does not fit
(RESOURCE_EXHAUSTED: ... exceeds available HBM); its message says how much it needed. A job
whose weights, gradients and optimizer state alone exceed a device is not compiled at all.
"""

from __future__ import annotations

import copy
import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax

from podtrain.config.schema import Config
from podtrain.errors import DoesNotFit
from podtrain.models import family
from podtrain.program.checks import validate
from podtrain.program.job import Job, build
from podtrain.runtime.chips import GiB, device_memory
from podtrain.runtime.mesh import build_mesh, slices, split_shape
from podtrain.sharding import RULES

_OOM = re.compile(r"RESOURCE_EXHAUSTED.*?\(([\d.]+)([KMGT])\) exceeds available HBM \(([\d.]+)([KMGT])\)", re.S)
_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
UNROLLED_SHARE = 0.9  # of a device's memory that `scan_unroll=auto` lets an unrolled step take


@dataclass
class Memory:
    """Bytes per device."""

    params: int
    optimizer: int  # moments, and the EMA where the run keeps one
    gradients: int  # a float32 copy of the local trained params, live inside the step (part of temporaries)
    temporaries: int | None  # XLA's temp buffers: activations, gradients, workspace (None: not compiled)
    total: int  # the step's peak: its arguments, temporaries and the outputs that do not reuse an argument
    available: float  # what one device holds
    whole_state: int  # weights, gradients and optimizer state of the whole model, unsharded

    @property
    def fits(self) -> bool:
        return self.total <= self.available

    @property
    def state(self) -> int:
        return self.params + self.optimizer + self.gradients

    def summary(self) -> str:
        """'params A + optimizer B + temporaries C (gradients D, activations and work space E) = T
        per device of L'."""
        rest = None if self.temporaries is None else self.temporaries - self.gradients
        return (
            f"params {size(self.params)} + optimizer {size(self.optimizer)} + temporaries {size(self.temporaries)} "
            f"(gradients {size(self.gradients)}, activations and work space {size(rest)}) = {size(self.total)} per "
            f"device of {size(self.available)}"
        )


def size(n: float | None) -> str:
    """Bytes as GiB, or MiB below a tenth of one."""
    return "-" if n is None else f"{n / GiB:.2f} GiB" if n >= GiB / 10 else f"{n / 2**20:.1f} MiB"


def local_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded jax.ShapeDtypeStructs."""
    return sum(math.prod(s.sharding.shard_shape(s.shape)) * s.dtype.itemsize for s in jax.tree.leaves(tree))


def global_bytes(tree) -> int:
    return sum(s.size * s.dtype.itemsize for s in jax.tree.leaves(tree))


def measure(job: Job, available: float) -> tuple[Memory, object | None]:
    """The step's memory per device, and the compiled step (None where it was not compiled or
    did not fit the TPU compiler)."""
    state = job.abstract_state
    trained = local_bytes(state["params"])  # and their gradients; LoRA's frozen base has none
    params = trained + local_bytes(state.get("base", {}))
    optimizer = local_bytes(state["opt"]) + local_bytes(state.get("ema", {}))
    kept = {k: v for k, v in state.items() if k in ("params", "base", "opt", "ema")}
    whole = global_bytes(kept) + global_bytes(state["params"])
    memory = Memory(params, optimizer, trained, None, params + trained + optimizer, available, whole)
    if memory.total > available:
        return memory, None
    try:
        compiled = job.compile()
    except jax.errors.JaxRuntimeError as e:  # the TPU compiler's out-of-memory refusal; anything else is a real error
        oom = _OOM.search(str(e))
        if not oom:
            raise
        memory.total = int(float(oom.group(1)) * _UNITS[oom.group(2)])
        memory.available = min(available, float(oom.group(3)) * _UNITS[oom.group(4)])
        return memory, None
    m = compiled.memory_analysis()
    memory.temporaries = m.temp_size_in_bytes
    memory.total = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    return memory, compiled


def unrolled(cfg: Config) -> Config:
    """cfg with every layer unrolled: scan_unroll the longest stack's length."""
    layers = max(getattr(cfg.model, k) for k in family(cfg.model).stacks)
    return changed(cfg, {"model.scan_unroll": layers})


def roomy(memory: Memory) -> bool:
    """Whether `scan_unroll=auto` takes a step of this memory unrolled: at most UNROLLED_SHARE of a device."""
    return memory.total <= UNROLLED_SHARE * memory.available


def settle_unroll(cfg: Config, compile_unrolled: Callable[[Config], tuple[Memory, Any]]) -> tuple[Config, Any]:
    """`model.scan_unroll=auto` on a GPU: every layer unrolled where that step, compiled by
    `compile_unrolled` into (its memory, what else it gives), is `roomy`, else scanned one layer at
    a time. Unrolled, XLA schedules across layers and fills and slices no stack of saved activations:
    the 1B recipe ran 1.15x as fast on an H100, in 37.3 GiB against 29.1. Returns the config and, if
    unrolled, what `compile_unrolled` gave."""
    if cfg.model.scan_unroll != "auto":
        return cfg, None
    memory, compiled = compile_unrolled(unrolled(cfg))
    return (unrolled(cfg), compiled) if roomy(memory) else (changed(cfg, {"model.scan_unroll": 1}), None)


def choose_unroll(cfg: Config, mesh, available: float) -> Config:
    """cfg with `scan_unroll=auto` settled for `mesh` of devices holding `available` bytes each."""
    return settle_unroll(cfg, lambda unrolled_cfg: measure(build(unrolled_cfg, mesh, data=False), available))[0]


def changed(cfg: Config, changes: dict) -> Config:
    """A copy of `cfg` with dotted keys set, checked like a config file."""
    cfg = copy.deepcopy(cfg)
    for key, value in changes.items():
        *path, last = key.split(".")
        setattr(functools.reduce(getattr, path, cfg), last, value)
    validate(cfg)
    return cfg


def describe(changes: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in changes.items())


def remedies(cfg: Config, n_devices: int, n_slices: int = 1) -> list[dict]:
    """The usual changes, one at a time and smallest first: more fsdp (taken from the data axis,
    within a slice), remat dots then full, a smaller microbatch with gradient accumulation; then
    all together."""
    shape, across = split_shape(cfg.mesh, n_devices, n_slices)
    data, fsdp = shape["data"], shape["fsdp"]
    t, policies = cfg.train, ("none", "dots", "full")
    sharded = [
        {f"mesh.{a}": size for a, size in shape.items()} | {"mesh.data": data // k, "mesh.fsdp": fsdp * k}
        for k in (2**i for i in range(1, 31))
        if data % k == 0
    ]
    remat = [{"model.remat": p} for p in policies[policies.index(cfg.model.remat) + 1 :]]
    dp = math.prod(shape[a] * across[a] for a in RULES["act_batch"])  # the microbatch splits over these
    accum = [
        {"train.grad_accum": a}
        for a in range(t.grad_accum + 1, t.batch_size + 1)
        if t.batch_size % a == 0 and (t.batch_size // a) % dp == 0
    ]
    most = {**(sharded[-1] if sharded else {}), "model.remat": "full"}
    return [*sharded, *remat, *accum, most, *({**most, **a} for a in accum)]


def devices_needed(memory: Memory) -> int:
    """The fewest devices (a power of two) over which fsdp shards the weights, gradients and
    optimizer state into half of one device, leaving the rest for activations."""
    return 2 ** math.ceil(math.log2(max(1.0, memory.whole_state / (memory.available / 2))))


def smallest_fix(cfg: Config, devices: list, attempt: Callable[[Config], object]) -> tuple[dict | None, object]:
    """The first of `remedies` for which `attempt(changed config)` (anything with `.fits`) fits,
    with that attempt; (None, None) if none does."""
    for changes in remedies(cfg, len(devices), len(slices(devices))):
        result = attempt(changed(cfg, changes))
        if result.fits:
            return changes, result
    return None, None


def advice(memory: Memory, n_devices: int, fix: dict | None) -> str:
    """What to change, in one sentence a user can act on."""
    need = f"needs {memory.total / GiB:.2f} GiB per device of {memory.available / GiB:.2f} GiB"
    if fix:
        return f"The step {need}. The smallest change that fits: {describe(fix)}."
    devices = devices_needed(memory)
    more = (
        f"Use more devices: about {devices} with the mesh's fsdp axis over them."
        if devices > n_devices
        else f"Over all {n_devices} devices fsdp would hold those in {memory.whole_state / n_devices / GiB:.2f} GiB "
        "each; what does not fit is the activations: split them over more devices (mesh.context for long "
        "windows) or shorten train.seq_len."
    )
    return (
        f"The step {need}, and no change of mesh, remat or microbatch on {n_devices} devices fits "
        f"(weights, gradients and optimizer state alone are {memory.state / GiB:.2f} GiB per device). {more}"
    )


def check(job: Job, cfg: Config, devices: list) -> Memory:
    """The step's memory per device; refuse, before anything is allocated, a job whose step does
    not fit these devices, naming the smallest change that does (what `train` runs ahead of its
    first step; the step compiled here is the one it then runs)."""
    available = device_memory(devices[0])
    memory, _ = measure(job, available)
    if memory.fits:
        return memory
    fix, _ = smallest_fix(
        cfg, devices, lambda c: measure(build(c, build_mesh(c.mesh, devices), data=False), available)[0]
    )
    raise DoesNotFit(f"{advice(memory, len(devices), fix)} `podtrain plan` with --target shows where the memory goes.")
