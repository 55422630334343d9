"""Building blocks shared by the models. Parameters and activations name logical axes; no mesh
appears here (`constrain` pins an activation by name, and the rules decide what that means).

Precision policy: parameters are stored in float32 and cast to the compute dtype where used;
norms, softmax statistics and logits are computed in float32.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from podtrain.runtime.mesh import constrain, per_shard, shards

ACT = ("act_batch", "act_seq", "act_embed")  # the residual stream (batch, seq, d_model)
HEADS = ("act_batch", "act_seq", "act_heads", "act_head_dim")
KV_HEADS = ("act_batch", "act_seq", "act_kv_heads", "act_head_dim")
LOGITS = ("act_batch", "act_seq", "act_vocab")
# Embedding tables and output heads in use: gathered over fsdp, split over the vocabulary under tensor.
TABLE, HEAD = ("act_vocab", "act_embed"), ("act_embed", "act_vocab")


def embed_tokens(table: jax.Array, tokens: jax.Array) -> jax.Array:
    """Rows of a (vocab, embed) table laid out as TABLE for (batch, seq) tokens: a lookup local
    to each batch shard (vocab-parallel under tensor: masked rows, then one all-reduce)."""
    return constrain(jnp.take(table, tokens, axis=0), ACT)


def output_head(x: jax.Array, head: jax.Array, dtype) -> jax.Array:
    """Logits of x (..., embed) through an (embed, vocab) head laid out as HEAD: inputs in the
    compute dtype, accumulated and returned in float32 (MaxText's logits_dot_in_fp32)."""
    return constrain(jnp.matmul(x.astype(dtype), head.astype(dtype), preferred_element_type=jnp.float32), LOGITS)


def param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str, ...], std: float) -> nnx.Param:
    """A float32 normal(0, std) parameter tagged with its logical axis names."""
    return nnx.Param(
        std * jax.random.normal(rngs.params(), shape, jnp.float32), out_sharding=axes, eager_sharding=False
    )


def rms_norm(x: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) over the last axis, computed in float32; no learned scale."""
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32), out_sharding=("embed",), eager_sharding=False)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        scale = jnp.expand_dims(self.scale[...], tuple(range(x.ndim - 1)))  # (1, ..., 1, dim)
        return (rms_norm(x, self.eps) * scale).astype(x.dtype)


def rope_tables(
    positions, head_dim: int, theta: float, llama3: tuple[float, float, float, int] | None = None
) -> tuple[jax.Array, jax.Array]:
    """cos and sin of shape (len(positions), head_dim // 2) for rotary position embeddings at
    `positions` (an int n: 0..n-1). `llama3` = (factor, low_freq_factor, high_freq_factor,
    original_max_len) stretches the long wavelengths as Llama 3 does for its longer context."""
    inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    if llama3 is not None:
        factor, low, high, original = llama3
        wavelen = 2 * jnp.pi / inv_freq
        smooth = jnp.clip(
            (original / wavelen - low) / (high - low), 0.0, 1.0
        )  # 0 beyond original / low, 1 below original / high
        inv_freq = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    positions = jnp.arange(positions) if isinstance(positions, int) else positions
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def document_mask(segment_ids: jax.Array) -> jax.Array:
    """(batch, 1, seq, seq): True where query and key are in the same segment (document)."""
    return (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]


def apply_rope(x: jax.Array, rope: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotate (batch, seq, heads, head_dim) by position, in the half-split layout of Llama."""
    cos, sin = (t[None, :, None, :] for t in rope)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


# Causal attention runs in this many blocks of queries, each reading only the keys up to its last
# query: 9/16 of the full score matrix is computed, and each block's scores are small enough to stay
# in cache between the softmax's passes (on 2 CPU cores, 8 blocks take ~0.6x the time of one).
CAUSAL_BLOCKS = 8
MIN_BLOCK = 32  # queries: a smaller block saves nothing worth its compile time


def causal_blocks(t: int) -> int:
    """The query blocks of a causal self-attention over t positions: up to CAUSAL_BLOCKS, whole and
    of at least MIN_BLOCK queries each. They compute (blocks + 1) / (2 blocks) of the scores."""
    blocks = CAUSAL_BLOCKS
    while blocks > 1 and (t % blocks or t // blocks < MIN_BLOCK):
        blocks //= 2
    return blocks


def grouped_attention(
    q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, mask: jax.Array | None = None, causal: bool = True
) -> jax.Array:
    """softmax(q k^T / sqrt(head_dim)) v, each k/v head read in place by its group of query heads
    (no copies); scores and softmax in float32. `mask` (batch or 1, 1, T, S): True where a query
    may attend to a key, and with `causal` only to keys at or before its own position."""
    b, t, n, h = q_BTNH.shape
    s, kv = k_BSKH.shape[1:3]
    q = q_BTNH.reshape(b, t, kv, n // kv, h) * jnp.asarray(
        h**-0.5, q_BTNH.dtype
    )  # scaled before the product: T x H, not T x S, multiplies
    allowed = jnp.ones((1, 1, t, 1, s), bool) if mask is None else mask[:, :, :, None]  # (B, 1, T, 1, S)
    if causal:
        allowed = allowed & jnp.tril(jnp.ones((t, s), bool))[None, None, :, None]
    bias = jnp.where(allowed, 0.0, -1e30).astype(jnp.float32)  # added, not selected: the backward needs no mask
    blocks = causal_blocks(t) if causal and t == s else 1
    return _attend(q, k_BSKH, v_BSKH, bias, blocks).reshape(b, t, n, h)


def _spans(t: int, s: int, blocks: int) -> list[tuple[int, int, int]]:
    """(first query, end of queries, end of keys) of each block; a causal block reads no key after its last query."""
    size = t // blocks
    return [(i * size, (i + 1) * size, (i + 1) * size if blocks > 1 else s) for i in range(blocks)]


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attend(q_BTKGH, k_BSKH, v_BSKH, bias, blocks):
    return _attend_fwd(q_BTKGH, k_BSKH, v_BSKH, bias, blocks)[0]


def _attend_fwd(q_BTKGH, k_BSKH, v_BSKH, bias, blocks):
    outs, probs = [], []
    for lo, hi, end in _spans(q_BTKGH.shape[1], k_BSKH.shape[1], blocks):
        scores = (
            jnp.einsum("btkgh,bskh->bktgs", q_BTKGH[:, lo:hi], k_BSKH[:, :end], preferred_element_type=jnp.float32)
            + bias[:, :, lo:hi, :, :end]
        )
        probs.append(jax.nn.softmax(scores, axis=-1))
        outs.append(jnp.einsum("bktgs,bskh->btkgh", probs[-1].astype(v_BSKH.dtype), v_BSKH[:, :end]))
    out = jnp.concatenate(outs, axis=1)
    return out, (q_BTKGH, k_BSKH, v_BSKH, probs, out, bias)


def _attend_bwd(blocks, residuals, d_out):
    """FlashAttention's backward, block by block: the softmax's row term sum_s dP P is sum_h dO O, a
    reduction over the head dimension instead of the keys. A masked score has P = 0: no gradient."""
    q, k, v, probs, out, bias = residuals
    row = jnp.einsum("btkgh,btkgh->bktg", d_out.astype(jnp.float32), out.astype(jnp.float32))
    dq, dk, dv = [], jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
    for (lo, hi, end), p in zip(_spans(q.shape[1], k.shape[1], blocks), probs):
        d_block = d_out[:, lo:hi]
        dv = dv.at[:, :end].add(
            jnp.einsum("bktgs,btkgh->bskh", p.astype(v.dtype), d_block, preferred_element_type=jnp.float32)
        )
        d_probs = jnp.einsum("btkgh,bskh->bktgs", d_block, v[:, :end], preferred_element_type=jnp.float32)
        d_scores = (p * (d_probs - row[:, :, lo:hi, :, None])).astype(q.dtype)
        dq.append(jnp.einsum("bktgs,bskh->btkgh", d_scores, k[:, :end]))
        dk = dk.at[:, :end].add(
            jnp.einsum("bktgs,btkgh->bskh", d_scores, q[:, lo:hi], preferred_element_type=jnp.float32)
        )
    return jnp.concatenate(dq, axis=1), dk.astype(k.dtype), dv.astype(v.dtype), jnp.zeros_like(bias)


_attend.defvjp(_attend_fwd, _attend_bwd)


def splash_attention(
    q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array, causal: bool = True, interpret: bool = False
) -> jax.Array:
    """softmax(q k^T / sqrt(head_dim)) v by the Pallas splash-attention kernel for TPU: scores
    live in VMEM block by block, never as a (seq, seq) array in HBM, forward and backward. Each
    device runs it on its shard (batch over data x fsdp, heads over tensor); a k/v head is
    repeated for its query heads. `interpret` runs the kernel on any backend (tests)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as masks,
    )

    n, head_dim = q_BTNH.shape[2:]
    k_BTNH, v_BTNH = (jnp.repeat(x, n // x.shape[2], axis=2) for x in (k_BTKH, v_BTKH))

    def local(q, k, v):  # this device's (batch, seq, heads, head_dim), as (batch, heads, seq, head_dim)
        q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
        t, heads = q.shape[2], q.shape[1]
        mask = masks.CausalMask((t, t)) if causal else masks.FullMask((t, t))
        kernel = splash.make_splash_mha(
            masks.MultiHeadMask([mask] * heads), head_shards=1, q_seq_shards=1, interpret=interpret
        )
        return jax.vmap(kernel)(q * jnp.asarray(head_dim**-0.5, q.dtype), k, v).transpose(0, 2, 1, 3)

    return per_shard(local, (HEADS,) * 3, HEADS)(q_BTNH, k_BTNH, v_BTNH)


class Attention(nnx.Module):
    """Grouped-query attention, causal unless told otherwise: n_kv_heads key/value heads shared by n_heads query heads."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int,
        *,
        std: float,
        out_std: float,
        dtype,
        implementation: str,
        rngs: nnx.Rngs,
        causal: bool = True,
    ):
        head_dim = d_model // n_heads
        self.wq = param(rngs, (d_model, n_heads, head_dim), ("embed", "heads", "head_dim"), std)
        self.wk = param(rngs, (d_model, n_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), std)
        self.wv = param(rngs, (d_model, n_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), std)
        self.wo = param(rngs, (n_heads, head_dim, d_model), ("heads", "head_dim", "embed"), out_std)
        self.dtype = dtype
        self.implementation = None if implementation == "auto" else implementation
        self.causal = causal

    def project(self, x_BTD: jax.Array, rope, share_kv: bool = True) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q, k and v of x, rotated by position. With `share_kv`, k/v heads that the head shards
        cannot split evenly get a copy per query head, so that q, k and v share one sharding
        (cuDNN's attention requires it; copying replicated weights is local)."""
        wq, wk, wv = (w[...].astype(self.dtype) for w in (self.wq, self.wk, self.wv))
        d, n_heads, head_dim = wq.shape
        n_kv, kv_axes = wk.shape[1], KV_HEADS
        if share_kv and n_kv % shards("act_heads", n_heads):
            wk, wv = (jnp.repeat(w, n_heads // n_kv, axis=1) for w in (wk, wv))
            n_kv, kv_axes = n_heads, HEADS
        group = n_heads // n_kv
        # One projection for q, k and v, laid out per k/v head (the shards never split a group), so
        # that the gradient reaches x through one matmul: one all-reduce, not three.
        w_qkv = jnp.concatenate([wq.reshape(d, n_kv, group, head_dim), wk[:, :, None], wv[:, :, None]], axis=2)
        qkv = constrain(jnp.einsum("btd,dngh->btngh", x_BTD, w_qkv), (*kv_axes[:3], None, "act_head_dim"))
        q = constrain(qkv[:, :, :, :group].reshape(*x_BTD.shape[:2], n_heads, head_dim), HEADS)
        k, v = (constrain(qkv[:, :, :, i], kv_axes) for i in (group, group + 1))
        return apply_rope(q, rope), apply_rope(k, rope), v

    def output(self, out_BTNH: jax.Array) -> jax.Array:
        return constrain(jnp.einsum("btnh,nhd->btd", out_BTNH, self.wo[...].astype(self.dtype)), ACT)

    def __call__(self, x_BTD: jax.Array, rope, mask: jax.Array | None = None) -> jax.Array:
        """`mask` (batch, 1, seq, seq), True where a query may attend to a key, narrows the causal
        mask (to keep packed documents apart). Megatron's layout: q, k, v column-parallel and the
        output row-parallel over heads, so that tensor parallelism costs one all-reduce of
        (batch, seq, d_model) forward and one backward."""
        q, k, v = self.project(x_BTD, rope)
        if self.implementation == "splash":
            out = splash_attention(q, k, v, self.causal)
        elif self.implementation == "cudnn":
            out = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=self.causal, implementation="cudnn")
        else:
            out = grouped_attention(q, k, v, mask, self.causal)
        return self.output(constrain(out, HEADS))

    def decode(
        self, x_BTD: jax.Array, rope, cache: tuple[jax.Array, jax.Array], start: jax.Array
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """Attention of the tokens x at positions start.. to themselves and everything before them,
        whose keys and values `cache` (batch, length, kv_heads, head_dim) holds; x's are written into
        it. Positions after the last written one are masked, whatever the cache holds there."""
        q, k, v = self.project(x_BTD, rope, share_kv=False)
        cache = tuple(
            jax.lax.dynamic_update_slice_in_dim(c, new.astype(c.dtype), start, axis=1) for c, new in zip(cache, (k, v))
        )
        mask = jnp.arange(cache[0].shape[1])[None, :] <= start + jnp.arange(x_BTD.shape[1])[:, None]
        out = grouped_attention(q, *cache, mask[None, None], causal=False)
        return self.output(out), cache


@jax.custom_vjp
def swiglu(gate_up: jax.Array) -> jax.Array:
    """silu(gate) * up of (..., 2, d_ff), gate first. The gradient of both halves is written in one
    pass; taking the halves as slices would write each padded to full size and then add them."""
    gate, up = gate_up[..., 0, :], gate_up[..., 1, :]
    return jax.nn.silu(gate) * up


def _swiglu_bwd(gate_up, d_hidden):
    gate, up = gate_up[..., 0, :], gate_up[..., 1, :]
    sig = jax.nn.sigmoid(gate)
    return (jnp.stack([d_hidden * up * sig * (1 + gate * (1 - sig)), d_hidden * gate * sig], axis=-2),)


swiglu.defvjp(lambda gate_up: (swiglu(gate_up), gate_up), _swiglu_bwd)


class SwiGLU(nnx.Module):
    """silu(x W_gate) * (x W_up) W_down over the last axis, whose logical name is `axis` for the
    weights; `x_axes` names x's axes. Column- then row-parallel over mlp: one all-reduce under tensor parallelism."""

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        std: float,
        out_std: float,
        dtype,
        rngs: nnx.Rngs,
        axis: str = "embed",
        x_axes: tuple[str, ...] = ACT,
    ):
        self.w_gate = param(rngs, (d_model, d_ff), (axis, "mlp"), std)
        self.w_up = param(rngs, (d_model, d_ff), (axis, "mlp"), std)
        self.w_down = param(rngs, (d_ff, d_model), ("mlp", axis), out_std)
        self.dtype, self.x_axes = dtype, x_axes

    def __call__(self, x: jax.Array) -> jax.Array:
        # gate and up as one matmul, so that the gradient reaches x through one all-reduce
        w_in = jnp.stack([self.w_gate[...], self.w_up[...]], axis=1).astype(self.dtype)  # (d, 2, d_ff)
        gate_up = constrain(jnp.einsum("...d,dkf->...kf", x, w_in), (*self.x_axes[:-1], None, "act_mlp"))
        hidden = swiglu(gate_up)
        return constrain(hidden @ self.w_down[...].astype(self.dtype), self.x_axes)


REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def scan_layers(layers: nnx.Module, x: jax.Array, *args, remat: str = "none", unroll: int = 1) -> jax.Array:
    """Run a stack of identical layers (created with `nnx.vmap`) over x with `lax.scan`.

    Compile time stays independent of depth; `remat` trades recomputation for activation memory.
    """
    graphdef, state = nnx.split(layers)

    def body(h, layer_state):
        return nnx.merge(graphdef, layer_state)(h, *args), None

    if remat != "none":
        body = jax.checkpoint(body, policy=REMAT_POLICIES[remat], prevent_cse=False)
    return jax.lax.scan(body, x, state, unroll=unroll)[0]


def stacked(n: int, make, rngs: nnx.Rngs) -> nnx.Module:
    """n independently initialised copies of `make(rngs)`, stacked on a leading `layers` axis."""

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def create(rngs):
        return make(rngs)

    return create(rngs)
