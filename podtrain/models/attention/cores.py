"""The attention cores, each a record of what it takes: the config's checks, the `auto` choice and
the configuration page read these records, and every core asks `sees` what a query sees.

A core computes softmax(q k^T) v over whole heads; the attention layer around it projects, rotates
and, when the mesh splits the sequence, runs it under a context strategy (attention/context.py).
"""

from __future__ import annotations

from dataclasses import dataclass

SPLASH_BLOCK = 128  # the splash-attention kernel's blocks of queries and keys: sequences are whole blocks


@dataclass(frozen=True)
class Core:
    name: str  # model.attention's value
    label: str  # how errors name it
    platforms: tuple[str, ...]  # where it runs; `auto` picks the first core listing the platform
    segments: bool  # keeps packed documents apart by segment ids
    windows: bool  # sliding windows
    softcap: bool  # soft-capped scores (Gemma 2)
    value_width: bool  # values whose head size differs from the queries' (latent attention)
    context: tuple[str, ...]  # the context strategies it runs under when the sequence is split
    block: int = 1  # sequences (and each context shard's) are whole multiples of this
    compute_dtypes: tuple[str, ...] = ()  # the compute dtypes it takes (empty: any)
    max_head_dim: int = 0  # the widest head it takes, in multiples of 8 (0: any)


CORES = {
    core.name: core
    for core in (
        Core("cudnn", "cuDNN's fused attention", ("gpu",), False, True, False, False, (), 1, ("bfloat16",), 128),
        Core("splash", "the splash kernel", ("tpu",), True, True, True, True, ("all_gather",), SPLASH_BLOCK),
        Core("xla", "XLA's attention", ("cpu", "gpu", "tpu"), True, True, True, True, ("all_gather", "ring")),
    )
}


def preferred(platform: str, compute_dtype: str, head_dim: int) -> Core:
    """The first core that runs on the platform and takes the dtype and head size."""
    return next(
        core
        for core in CORES.values()
        if platform in core.platforms
        and (not core.compute_dtypes or compute_dtype in core.compute_dtypes)
        and (not core.max_head_dim or (head_dim <= core.max_head_dim and head_dim % 8 == 0))
    )


def sees(q_at, k_at, causal: bool, window=None):
    """Whether a query at place q_at sees a key at k_at (numpy or jax arrays that broadcast): a
    key at or before it when `causal` (else any key), within `window` places of it on either
    side it sees (None, 0 or less: no window)."""
    ok = k_at <= q_at if causal else (k_at <= q_at) | (k_at > q_at)
    if window is None:
        return ok
    return ok & (((q_at - k_at < window) & (k_at - q_at < window)) | (window <= 0))
