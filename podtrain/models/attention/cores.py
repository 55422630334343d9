"""The attention cores, by `model.attention` (`CORES`): each a record of what it takes and of the
function that computes it. The config's checks, the `auto` choice and the configuration page read
these records, and the attention layers call `core.run`.

A core computes softmax(q k^T) v over whole heads; the attention layer around it projects and
rotates. When the mesh splits the sequence, the core attends across the split itself: xla under a
context strategy (attention/context.py), splash by gathering every shard's keys.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp

from podtrain.models.attention.context import STRATEGIES, context_attention
from podtrain.models.attention.kernels import SPLASH_BLOCK, splash_attention
from podtrain.models.attention.xla import grouped_attention
from podtrain.sharding import context_strategy, positions_of


@dataclass(frozen=True)
class Core:
    name: str  # model.attention's value
    label: str  # how errors name it
    # (q, k, v, *, causal, scale, softcap, segments, window, windows, order, positions) -> the heads' output:
    # `windows` the layers' distinct sliding windows (for a kernel that needs them static), `order` the
    # positions' order where the mesh splits the sequence (else None), `positions` (batch, seq) or None
    run: Callable[..., jax.Array]
    platforms: tuple[str, ...]  # where it runs; `auto` picks the first core listing the platform
    segments: bool  # keeps packed documents apart by segment ids
    windows: bool  # sliding windows
    softcap: bool  # soft-capped scores (Gemma 2)
    value_width: bool  # values whose head size differs from the queries' (latent attention)
    context: tuple[str, ...]  # the context strategies it runs under when the sequence is split
    block: int = 1  # sequences (and each context shard's) are whole multiples of this
    compute_dtypes: tuple[str, ...] = ()  # the compute dtypes it takes (empty: any)
    max_head_dim: int = 0  # the widest head it takes, in multiples of 8 (0: any)


def by_window(kernel, windows: tuple[int, ...], window, *args) -> jax.Array:
    """A kernel whose window is static (`kernel(w)` -> a function of q, k, v) on a layer's `window`:
    a stack whose layers differ in window (`windows`) runs the kernel of each (lax.switch on the
    layer's own); without a window, or windows to switch between, the kernel of none."""
    kernels = [kernel(w) for w in (windows if window is not None else ()) or (0,)]
    if len(kernels) == 1:
        return kernels[0](*args)
    return jax.lax.switch(jnp.argmax(jnp.asarray(windows) == window), kernels, *args)


def _xla(q, k, v, *, causal, scale, softcap=0.0, segments=None, window=None, windows=(), order=None, positions=None):
    """Grouped-query attention in XLA's operations; over a split sequence, by the context strategy
    of the function being traced, the tokens at `positions` (in order where not given)."""
    if order is not None:
        if positions is None:  # in order: a caller that is not causal (the puzzles' models) needs no other
            positions = positions_of(q.shape)
        return context_attention(
            q,
            k,
            v,
            positions,
            segments,
            window,
            strategy=context_strategy(),
            causal=causal,
            scale=scale,
            softcap=softcap,
        )
    pair = None if segments is None else (segments, segments)
    return grouped_attention(q, k, v, causal, scale, softcap, segments=pair, window=window)


def _splash(q, k, v, *, causal, scale, softcap=0.0, segments=None, window=None, windows=(), order=None, positions=None):
    """Pallas's splash kernel for TPU, its mask made for each of the layers' windows."""

    def kernel(w):
        run = partial(splash_attention, causal=causal, scale=scale, softcap=softcap, window=w)
        return partial(run, order=order, segments=segments)

    return by_window(kernel, windows, window, q, k, v)


def _cudnn(q, k, v, *, causal, scale, softcap=0.0, segments=None, window=None, windows=(), order=None, positions=None):
    """cuDNN's fused attention: no segments, soft-caps or split sequence (program/checks.py refuses
    them); a window w is its local_window_size (w - 1 keys before the query)."""

    def kernel(w):
        sight = {"local_window_size": (w - 1, 0)} if w else {}
        return partial(jax.nn.dot_product_attention, scale=scale, is_causal=causal, implementation="cudnn", **sight)

    return by_window(kernel, windows, window, q, k, v)


CORES = {
    core.name: core
    for core in (
        Core(
            "cudnn", "cuDNN's fused attention", _cudnn, ("gpu",), False, True, False, False, (), 1, ("bfloat16",), 128
        ),
        Core("splash", "the splash kernel", _splash, ("tpu",), True, True, True, True, ("all_gather",), SPLASH_BLOCK),
        Core("xla", "XLA's attention", _xla, ("cpu", "gpu", "tpu"), True, True, True, True, tuple(STRATEGIES)),
    )
}
PORTABLE = "xla"  # the core that runs everywhere and takes every job: `auto`'s where another refuses


def named(name: str) -> Core:
    """The core `model.attention=name` names; `auto` that no platform resolved (a model built by
    hand) is the portable one."""
    return CORES[PORTABLE if name == "auto" else name]


def preferred(platform: str, compute_dtype: str, head_dim: int) -> Core:
    """The first core that runs on the platform and takes the dtype and head size."""
    return next(
        core
        for core in CORES.values()
        if platform in core.platforms
        and (not core.compute_dtypes or compute_dtype in core.compute_dtypes)
        and (not core.max_head_dim or (head_dim <= core.max_head_dim and head_dim % 8 == 0))
    )
