"""Fused attention kernels: Pallas's splash attention for TPU, and what cuDNN's kernel holds and
moves, standing in for it in a GPU plan compiled on a CPU."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from podtrain.models.layers import HEADS, KV_HEADS, SEGMENTS
from podtrain.sharding import per_shard

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
) -> jax.Array:
    """softmax(q k^T * scale) v (scale 1/sqrt(head_dim) unless given; scores soft-capped by
    `softcap` when set; causal queries see only the `window` latest keys when set, and with
    `segments` (batch, seq) only keys of their own segment) by the Pallas
    splash-attention kernel for TPU, whose blocks outside the mask are skipped: scores
    live in VMEM block by block, never as a (seq, seq) array in HBM, forward and backward. Each
    device runs it on its shard (batch over data x fsdp, heads over tensor); a k/v head is
    repeated for its query heads. `interpret` runs the kernel on any backend (tests)."""
    # Imported where used: loading Pallas's TPU kernels costs a second, for TPU jobs only.
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    n, head_dim = q_BTNH.shape[2:]
    k_BTNH, v_BTNH = (jnp.repeat(x, n // x.shape[2], axis=2) for x in (k_BTKH, v_BTKH))

    def local(q, k, v, segments=None):  # this device's (batch, seq, heads, head_dim), as (batch, heads, seq, head_dim)
        q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
        t, heads = q.shape[2], q.shape[1]
        if window:
            mask = masks.LocalMask((t, t), window_size=(window - 1, 0 if causal else window - 1), offset=0)
        else:
            mask = masks.CausalMask((t, t)) if causal else masks.FullMask((t, t))
        kernel = splash.make_splash_mha(
            masks.MultiHeadMask([mask] * heads),
            head_shards=1,
            q_seq_shards=1,
            interpret=interpret,
            attn_logits_soft_cap=softcap or None,
        )
        q = q * jnp.asarray(scale or head_dim**-0.5, q.dtype)
        if segments is None:
            return jax.vmap(kernel)(q, k, v).transpose(0, 2, 1, 3)
        ids = jax.vmap(lambda s: splash.SegmentIds(q=s, kv=s))(segments)
        return jax.vmap(lambda q, k, v, ids: kernel(q, k, v, segment_ids=ids))(q, k, v, ids).transpose(0, 2, 1, 3)

    if segments is None:
        return per_shard(local, (HEADS,) * 3, HEADS)(q_BTNH, k_BTNH, v_BTNH)
    return per_shard(local, (HEADS,) * 3 + (SEGMENTS,), HEADS)(q_BTNH, k_BTNH, v_BTNH, segments)


def _not_run(*_):
    raise RuntimeError(
        "model.attention=cudnn_estimate only stands in for cuDNN's kernel in a plan; it computes nothing"
    )


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _fused_stand_in(q_BTNH, k_BTKH, v_BTKH, causal):
    return _stand_in_fwd(q_BTNH, k_BTKH, v_BTKH, causal)[0]


def _stand_in_fwd(q_BTNH, k_BTKH, v_BTKH, causal):
    b, t, n, _ = q_BTNH.shape
    shapes = (jax.ShapeDtypeStruct(q_BTNH.shape, q_BTNH.dtype), jax.ShapeDtypeStruct((b, n, t), jnp.float32))
    out, lse = jax.pure_callback(_not_run, shapes, q_BTNH, k_BTKH, v_BTKH)
    return out, (q_BTNH, k_BTKH, v_BTKH, out, lse)


def _stand_in_bwd(causal, residuals, d_out):
    q, k, v, out, lse = residuals
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    return jax.pure_callback(_not_run, shapes, q, k, v, out, lse, d_out)


_fused_stand_in.defvjp(_stand_in_fwd, _stand_in_bwd)


def fused_attention_stand_in(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array, causal: bool = True):
    """What a fused attention kernel (cuDNN's, FlashAttention) holds and moves, for a GPU plan
    compiled on a CPU: forward, it reads q, k, v and writes the output and its softmax statistics
    (batch, heads, seq) in float32; backward, it reads those with the output's gradient and writes
    the gradients of q, k and v. No (seq, seq) scores exist, as in the kernel. Host callbacks that
    are compiled, never run, stand for its two passes, per device shard; its FLOPs are the
    model's (the plan's compute time takes at least those)."""
    run = per_shard(lambda q, k, v: _fused_stand_in(q, k, v, causal), (HEADS, KV_HEADS, KV_HEADS), HEADS)
    return run(q_BTNH, k_BTKH, v_BTKH)
