"""Low-rank adapters (LoRA, Hu et al. 2021) on a built model's projections.

A module lists the weights it lets be adapted in `adaptable` ({name: how many of the weight's
leading axes x contracts}). `attach` gives each chosen weight W (in..., out...) an `Adapter`
`lora_<name>`: A (in..., rank), B (rank, out...), B starting at zero, so that the adapted model
starts as the base. The module adds `low_rank(self, name, x)` = (alpha / rank) (x A) B to its x W:
the product A B is never formed, and a frozen W gets no weight gradient, only x's.

Dropout on the adapters' input (PEFT's lora_dropout) runs while a train step holds a key
(`dropout_key`): each adapter draws its mask from that key, the layer's index (`layer`, set by
the layer scan) and its own number, so no two adapters of a step share one.
"""

from __future__ import annotations

import contextvars
import math
from contextlib import contextmanager

import jax
import jax.numpy as jnp
from flax import nnx

PREFIX = "lora_"  # an adapter's attribute, and so its parameters' path: lora_<weight>/{a,b}
# The weights a user may adapt, by the projection names PEFT and train.lora.targets give them.
PROJECTIONS = {
    "wq": "q_proj",
    "wk": "k_proj",
    "wv": "v_proj",
    "wo": "o_proj",
    "w_gate": "gate_proj",
    "w_up": "up_proj",
    "w_down": "down_proj",
}
_KEY: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar("podtrain_lora_dropout", default=None)


@contextmanager
def dropout_key(key: jax.Array | None):
    """Adapters traced inside draw their dropout masks from `key` (None: no dropout)."""
    token = _KEY.set(key)
    try:
        yield
    finally:
        _KEY.reset(token)


@contextmanager
def layer(index: jax.Array):
    """Inside a layer of a scanned stack: its index joins the dropout key, if there is one."""
    key = _KEY.get()
    with dropout_key(None if key is None else jax.random.fold_in(key, index)):
        yield


class Adapter(nnx.Module):
    """A and B for `weight` (its stacked `layers` axes first), laid out by the weight's own axes and
    `lora` for the rank. A is uniform in +-1/sqrt(fan_in), as PEFT's Kaiming init with a = sqrt(5)."""

    def __init__(self, weight: nnx.Param, n_in: int, rank: int, scale: float, rngs: nnx.Rngs, dropout=0.0, number=0):
        axes = weight.get_metadata()["out_sharding"]
        lead = next(i for i, name in enumerate(axes) if name != "layers")
        shape = weight.shape
        fan_in = math.prod(shape[lead : lead + n_in])
        a_axes, b_axes = (*axes[: lead + n_in], "lora"), (*axes[:lead], "lora", *axes[lead + n_in :])
        a_shape, b_shape = (*shape[: lead + n_in], rank), (*shape[:lead], rank, *shape[lead + n_in :])
        bound = 1 / math.sqrt(fan_in)
        a = jax.random.uniform(rngs.params(), a_shape, jnp.float32, -bound, bound)
        self.a = nnx.Param(a, out_sharding=a_axes, eager_sharding=False)
        self.b = nnx.Param(jnp.zeros(b_shape, jnp.float32), out_sharding=b_axes, eager_sharding=False)
        self.scale, self.dropout, self.number = scale, dropout, number

    def __call__(self, x: jax.Array, dtype) -> jax.Array:
        a, b = self.a[...].astype(dtype), self.b[...].astype(dtype)
        if self.dropout and (key := _KEY.get()) is not None:
            kept = jax.random.bernoulli(jax.random.fold_in(key, self.number), 1 - self.dropout, x.shape)
            x = jnp.where(kept, x / (1 - self.dropout), 0).astype(x.dtype)
        low = jnp.tensordot(x.astype(dtype), a, axes=a.ndim - 1)  # (..., rank)
        return jnp.tensordot(low * jnp.asarray(self.scale, dtype), b, axes=1)


def low_rank(module: nnx.Module, name: str, x: jax.Array, dtype) -> jax.Array | None:
    """The adapter's term of `module`'s projection `name` of x, or None where it has none."""
    adapter = getattr(module, PREFIX + name, None)
    return None if adapter is None else adapter(x, dtype)


def adapted(module: nnx.Module) -> bool:
    return any(hasattr(module, PREFIX + name) for name in getattr(module, "adaptable", {}))


def attach(
    model: nnx.Module, names: set[str], rank: int, alpha: float, rngs: nnx.Rngs, dropout: float = 0.0
) -> nnx.Module:
    """`model` with an adapter of `rank` on each weight in `names` that a module lets be adapted,
    its input dropped out at rate `dropout` in training."""
    chosen = [
        (module, name, n_in)
        for _, module in nnx.iter_modules(model)
        for name, n_in in getattr(module, "adaptable", {}).items()
        if name in names
    ]
    for number, (module, name, n_in) in enumerate(chosen):
        adapter = Adapter(getattr(module, name), n_in, rank, alpha / rank, rngs, dropout, number)
        setattr(module, PREFIX + name, adapter)
    return model


def split(tree: dict) -> tuple[dict, dict]:
    """(the adapters, the rest) of a params tree, each a tree of the same nesting."""
    adapters, rest = {}, {}
    for key, value in tree.items():
        if str(key).startswith(PREFIX):
            adapters[key] = value
        elif isinstance(value, dict):
            inner_adapters, inner_rest = split(value)
            if inner_adapters:
                adapters[key] = inner_adapters
            if inner_rest:
                rest[key] = inner_rest
        else:
            rest[key] = value
    return adapters, rest


def union(base: dict, adapters: dict) -> dict:
    """The params tree of both halves (the inverse of `split`)."""
    whole = dict(base)
    for key, value in adapters.items():
        whole[key] = union(whole[key], value) if isinstance(value, dict) and key in whole else value
    return whole
