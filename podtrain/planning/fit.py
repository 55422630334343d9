"""The smallest usual change that makes a job fit its devices' memory, and what to say when none does.

The memory itself is XLA's answer for the compiled step (`podtrain.program.memory`); a change is
tried by preparing the changed job, compiled from abstract shapes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from podtrain.config.schema import Config
from podtrain.errors import DoesNotFit
from podtrain.models.layers import REMAT_POLICIES
from podtrain.program.checks import changed
from podtrain.program.memory import Memory
from podtrain.program.prepare import Prepared, prepare
from podtrain.runtime.chips import GiB
from podtrain.runtime.mesh import build_mesh, slices, split_shape
from podtrain.sharding import RULES


def describe(changes: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in changes.items())


def remedies(cfg: Config, n_devices: int, n_slices: int = 1) -> list[dict]:
    """The usual changes, one at a time and smallest first: more fsdp (taken from the data axis,
    within a slice), remat dots then full, a smaller microbatch with gradient accumulation; then
    all together."""
    shape, across = split_shape(cfg.mesh, n_devices, n_slices)
    data, fsdp = shape["data"], shape["fsdp"]
    t, policies = cfg.train, list(REMAT_POLICIES)  # least recomputation first
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
    most = {**(sharded[-1] if sharded else {}), "model.remat": policies[-1]}
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


def check(ready: Prepared, devices: list) -> None:
    """Refuse, before anything is allocated, a job whose step does not fit these devices, naming the
    smallest change that does (what `train` runs ahead of its first step)."""
    if ready.memory.fits:
        return
    available, platform = ready.memory.available, devices[0].platform
    fix, _ = smallest_fix(
        ready.cfg, devices, lambda c: prepare(c, platform, build_mesh(c.mesh, devices), available, data=False).memory
    )
    raise DoesNotFit(
        f"{advice(ready.memory, len(devices), fix)} `podtrain plan` with --target shows where the memory goes."
    )
