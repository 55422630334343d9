"""Pallas's splash attention for TPU, on each shard of the mesh (cuDNN's fused attention is
jax.nn.dot_product_attention's, called by its core in cores.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from podtrain.models.attention.xla import sees
from podtrain.models.layers import HEADS, SEGMENTS
from podtrain.sharding import gather, per_shard, shards

SPLASH_BLOCK = 128  # the splash-attention kernel's blocks of queries and keys: sequences are whole blocks


def splash_attention(
    q_BTNH: jax.Array,
    k_BTKH: jax.Array,
    v_BTKH: jax.Array,
    causal: bool = True,
    interpret: bool = False,
    scale: float | None = None,
    softcap: float = 0.0,
    window: int = 0,
    segments: jax.Array | None = None,
    order: np.ndarray | None = None,
) -> jax.Array:
    """softmax(q k^T * scale) v (scale 1/sqrt(head_dim) unless given; scores soft-capped by
    `softcap` when set; causal queries see only the `window` latest keys when set, and with
    `segments` (batch, seq) only keys of their own segment) by the Pallas
    splash-attention kernel for TPU, whose blocks outside the mask are skipped: scores
    live in VMEM block by block, never as a (seq, seq) array in HBM, forward and backward. Each
    device runs it on its shard (batch over data x fsdp, heads over tensor); a k/v head is
    repeated for its query heads. `interpret` runs the kernel on any backend (tests).

    When the sequence is split over devices (context), the tokens are in `order` (their
    positions, static: `sharding.balanced_order`); each device keeps its queries and gathers
    every shard's keys and values, put back in position order, and the kernel's mask is cut by
    query rows as MaxText's all-gather strategy does."""
    # Imported where used: loading Pallas's TPU kernels costs a second, for TPU jobs only.
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    t, n, head_dim = q_BTNH.shape[1:]
    group = n // k_BTKH.shape[2]
    order = np.arange(t) if order is None else order
    split, unsplit = shards("act_seq", t), np.argsort(order)  # keys back in position order
    mask = _sight(masks)((t, t), order, causal, window)
    kernel = splash.make_splash_mha(
        masks.MultiHeadMask([mask] * n),
        head_shards=shards("act_heads", n),
        q_seq_shards=split,
        interpret=interpret,
        attn_logits_soft_cap=softcap or None,
    )

    def whole(x, axis):  # every shard's keys (or their segment ids), in position order
        return jnp.take(gather(x, "act_seq", axis=axis), unsplit, axis=axis) if split > 1 else x

    def local(q, k, v, *rest):  # this device's (batch, seq, heads, head_dim), as (batch, heads, seq, head_dim)
        q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
        k, v = (jnp.repeat(whole(x, 2), group, axis=1) for x in (k, v))  # gathered before the copies per query head
        q = q * jnp.asarray(scale or head_dim**-0.5, q.dtype)
        kernel = rest[-1]
        if len(rest) == 1:
            return jax.vmap(kernel)(q, k, v).transpose(0, 2, 1, 3)
        ids = jax.vmap(lambda q_ids, kv_ids: splash.SegmentIds(q=q_ids, kv=kv_ids))(rest[0], whole(rest[0], 1))
        return jax.vmap(lambda q, k, v, ids: kernel(q, k, v, segment_ids=ids))(q, k, v, ids).transpose(0, 2, 1, 3)

    def kernel_spec(placed):  # each device's share of the mask's blocks: its heads and its query rows
        return kernel.manual_sharding_spec(placed(("act_heads", "act_seq"), (n, t)))

    arrays = (q_BTNH, k_BTKH, v_BTKH) + (() if segments is None else (segments,))
    names = (HEADS,) * 3 + (() if segments is None else (SEGMENTS,))
    return per_shard(local, (*names, kernel_spec), HEADS)(*arrays, kernel)


def _sight(masks):
    """The splash mask class of what a query sees, queries in any static order: keys at or before
    its position (`causal`), within `window` of it on either side that it sees (0: all)."""

    class Sight(masks._ComputableMask):
        def __init__(self, shape, order, causal, window):
            super().__init__(shape=shape, mask_function=lambda q_at, k_at: sees(q_at, k_at, causal, window))
            self.q_sequence = np.asarray(order, np.int32)
            self.key = (shape, causal, window, self.q_sequence.tobytes())

        def __eq__(self, other):
            return isinstance(other, Sight) and self.key == other.key

        def __hash__(self):
            return hash(self.key)

    return Sight
