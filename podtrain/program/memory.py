"""A compiled step's memory per device, from XLA: the train step compiled ahead of time for the
devices, its `memory_analysis()` against what one device holds. The TPU compiler refuses a program
that does not fit (RESOURCE_EXHAUSTED: ... exceeds available HBM); its message says how much it
needed. A job whose weights, gradients and optimizer state alone exceed a device is not compiled.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import jax
from podtrain.program.job import Job
from podtrain.runtime.chips import GiB

_OOM = re.compile(r"RESOURCE_EXHAUSTED.*?\(([\d.]+)([KMGT])\) exceeds available HBM \(([\d.]+)([KMGT])\)", re.S)
_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


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
