"""Attention: grouped-query attention with FlashAttention's backward (the xla path), cuDNN's
fused kernel, and the Pallas splash-attention kernel for TPU; the module that projects to heads
and back, with rotary positions and a key/value cache for generation."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from podtrain.models.layers import ACT, HEADS, KV_HEADS, RMSNorm, apply_rope, param, window_mask
from podtrain.sharding import constrain, per_shard, shards

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
    q_BTNH: jax.Array,
    k_BSKH: jax.Array,
    v_BSKH: jax.Array,
    mask: jax.Array | None = None,
    causal: bool = True,
    scale: float | None = None,
    softcap: float = 0.0,
) -> jax.Array:
    """softmax(q k^T * scale) v, scale 1/sqrt(head_dim) unless given, each k/v head read in place
    by its group of query heads (no copies); scores and softmax in float32. `mask` (batch or 1, 1,
    T, S): True where a query may attend to a key, and with `causal` only to keys at or before its
    own position. A `softcap` c bounds the scores to (-c, c) as c tanh(s / c), before the mask (Gemma 2)."""
    b, t, n, h = q_BTNH.shape
    s, kv = k_BSKH.shape[1:3]
    # Scaled before the product: T x H, not T x S, multiplies.
    q = q_BTNH.reshape(b, t, kv, n // kv, h) * jnp.asarray(scale or h**-0.5, q_BTNH.dtype)
    allowed = jnp.ones((1, 1, t, 1, s), bool) if mask is None else mask[:, :, :, None]  # (B, 1, T, 1, S)
    if causal:
        allowed = allowed & jnp.tril(jnp.ones((t, s), bool))[None, None, :, None]
    bias = jnp.where(allowed, 0.0, -1e30).astype(jnp.float32)  # added, not selected: the backward needs no mask
    blocks = causal_blocks(t) if causal and t == s else 1
    return _attend(q, k_BSKH, v_BSKH, bias, blocks, softcap).reshape(b, t, n, h)


def _spans(t: int, s: int, blocks: int) -> list[tuple[int, int, int]]:
    """(first query, end of queries, end of keys) of each block; a causal block reads no key after its last query."""
    size = t // blocks
    return [(i * size, (i + 1) * size, (i + 1) * size if blocks > 1 else s) for i in range(blocks)]


def _scores(q_BTKGH, k_BSKH, softcap: float) -> jax.Array:
    """(B, K, T, G, S) float32 scores, soft-capped when `softcap` is set."""
    scores = jnp.einsum("btkgh,bskh->bktgs", q_BTKGH, k_BSKH, preferred_element_type=jnp.float32)
    return softcap * jnp.tanh(scores / softcap) if softcap else scores


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attend(q_BTKGH, k_BSKH, v_BSKH, bias, blocks, softcap):
    return _attend_fwd(q_BTKGH, k_BSKH, v_BSKH, bias, blocks, softcap)[0]


def _attend_fwd(q_BTKGH, k_BSKH, v_BSKH, bias, blocks, softcap):
    outs, probs = [], []
    for lo, hi, end in _spans(q_BTKGH.shape[1], k_BSKH.shape[1], blocks):
        scores = _scores(q_BTKGH[:, lo:hi], k_BSKH[:, :end], softcap) + bias[:, :, lo:hi, :, :end]
        probs.append(jax.nn.softmax(scores, axis=-1))
        outs.append(jnp.einsum("bktgs,bskh->btkgh", probs[-1].astype(v_BSKH.dtype), v_BSKH[:, :end]))
    out = jnp.concatenate(outs, axis=1)
    return out, (q_BTKGH, k_BSKH, v_BSKH, probs, out, bias)


def _attend_bwd(blocks, softcap, residuals, d_out):
    """FlashAttention's backward, block by block: the softmax's row term sum_s dP P is sum_h dO O, a
    reduction over the head dimension instead of the keys. A masked score has P = 0: no gradient.
    Through a soft-cap, the capped score c tanh(s / c) is recomputed: its derivative is 1 - tanh²."""
    q, k, v, probs, out, bias = residuals
    row = jnp.einsum("btkgh,btkgh->bktg", d_out.astype(jnp.float32), out.astype(jnp.float32))
    dq, dk, dv = [], jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
    for (lo, hi, end), p in zip(_spans(q.shape[1], k.shape[1], blocks), probs):
        d_block = d_out[:, lo:hi]
        dv = dv.at[:, :end].add(
            jnp.einsum("bktgs,btkgh->bskh", p.astype(v.dtype), d_block, preferred_element_type=jnp.float32)
        )
        d_probs = jnp.einsum("btkgh,bskh->bktgs", d_block, v[:, :end], preferred_element_type=jnp.float32)
        d_scores = p * (d_probs - row[:, :, lo:hi, :, None])
        if softcap:
            d_scores = d_scores * (1 - jnp.square(_scores(q[:, lo:hi], k[:, :end], softcap) / softcap))
        d_scores = d_scores.astype(q.dtype)
        dq.append(jnp.einsum("bktgs,bskh->btkgh", d_scores, k[:, :end]))
        dk = dk.at[:, :end].add(
            jnp.einsum("bktgs,btkgh->bskh", d_scores, q[:, lo:hi], preferred_element_type=jnp.float32)
        )
    return jnp.concatenate(dq, axis=1), dk.astype(k.dtype), dv.astype(v.dtype), jnp.zeros_like(bias)


_attend.defvjp(_attend_fwd, _attend_bwd)


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
) -> jax.Array:
    """softmax(q k^T * scale) v (scale 1/sqrt(head_dim) unless given; scores soft-capped by
    `softcap` when set; causal queries see only the `window` latest keys when set) by the Pallas
    splash-attention kernel for TPU, whose blocks outside the mask are skipped: scores
    live in VMEM block by block, never as a (seq, seq) array in HBM, forward and backward. Each
    device runs it on its shard (batch over data x fsdp, heads over tensor); a k/v head is
    repeated for its query heads. `interpret` runs the kernel on any backend (tests)."""
    # Imported where used: loading Pallas's TPU kernels costs a second, for TPU jobs only.
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    n, head_dim = q_BTNH.shape[2:]
    k_BTNH, v_BTNH = (jnp.repeat(x, n // x.shape[2], axis=2) for x in (k_BTKH, v_BTKH))

    def local(q, k, v):  # this device's (batch, seq, heads, head_dim), as (batch, heads, seq, head_dim)
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
        return jax.vmap(kernel)(q * jnp.asarray(scale or head_dim**-0.5, q.dtype), k, v).transpose(0, 2, 1, 3)

    return per_shard(local, (HEADS,) * 3, HEADS)(q_BTNH, k_BTNH, v_BTNH)


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


class Attention(nnx.Module):
    """Grouped-query attention, causal unless told otherwise: n_kv_heads key/value heads shared by
    n_heads query heads of head_dim each. The options of the Hugging Face families: `bias` on the
    q, k and v projections ("qkv", Qwen2) or on all four ("all"), `qk_norm`, an RMSNorm over
    head_dim of each query and key head before the rotation (Qwen3, Gemma 3), the scores' `scale`
    (Gemma's query_pre_attn_scalar^-0.5) and their `softcap` (Gemma 2)."""

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
        head_dim: int = 0,
        bias: str = "none",
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        norm_plus_one: bool = False,
        scale: float | None = None,
        softcap: float = 0.0,
        windows: tuple[int, ...] = (),
    ):
        head_dim = head_dim or d_model // n_heads
        self.wq = param(rngs, (d_model, n_heads, head_dim), ("embed", "heads", "head_dim"), std)
        self.wk = param(rngs, (d_model, n_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), std)
        self.wv = param(rngs, (d_model, n_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), std)
        self.wo = param(rngs, (n_heads, head_dim, d_model), ("heads", "head_dim", "embed"), out_std)
        if bias != "none":
            self.bq = param(rngs, (n_heads, head_dim), ("heads", "head_dim"), 0.0)
            self.bk = param(rngs, (n_kv_heads, head_dim), ("kv_heads", "head_dim"), 0.0)
            self.bv = param(rngs, (n_kv_heads, head_dim), ("kv_heads", "head_dim"), 0.0)
        if bias == "all":
            self.bo = param(rngs, (d_model,), ("embed",), 0.0)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, norm_eps, axis="head_dim", plus_one=norm_plus_one)
            self.k_norm = RMSNorm(head_dim, norm_eps, axis="head_dim", plus_one=norm_plus_one)
        self.dtype, self.bias, self.qk_norm = dtype, bias, qk_norm
        self.scale, self.softcap = scale or head_dim**-0.5, softcap
        self.windows = windows  # the layers' distinct sliding windows (0: none), for kernels that need them static
        self.implementation = None if implementation == "auto" else implementation
        self.causal = causal

    def project(self, x_BTD: jax.Array, rope, share_kv: bool = True) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q, k and v of x, rotated by position. With `share_kv`, k/v heads that the head shards
        cannot split evenly get a copy per query head, so that q, k and v share one sharding
        (cuDNN's attention requires it; copying replicated weights is local)."""
        names = ("wq", "wk", "wv") + (("bq", "bk", "bv") if self.bias != "none" else ())
        w = {name: getattr(self, name)[...].astype(self.dtype) for name in names}
        d, n_heads, head_dim = w["wq"].shape
        n_kv, kv_axes = w["wk"].shape[1], KV_HEADS
        if share_kv and n_kv % shards("act_heads", n_heads):
            for name in ("wk", "wv", "bk", "bv"):
                if name in w:  # heads: axis 1 of a weight, 0 of a bias
                    w[name] = jnp.repeat(w[name], n_heads // n_kv, axis=1 if name[0] == "w" else 0)
            n_kv, kv_axes = n_heads, HEADS
        group = n_heads // n_kv

        def per_kv_head(q, k, v, heads: int):
            """q, k, v (head axis at `heads`) as (..., n_kv, group + 2, ...): a group's queries, its k, its v."""
            q = q.reshape(*q.shape[:heads], n_kv, group, *q.shape[heads + 1 :])
            return jnp.concatenate([q, jnp.expand_dims(k, heads + 1), jnp.expand_dims(v, heads + 1)], axis=heads + 1)

        # One projection for q, k and v, laid out per k/v head (the shards never split a group), so
        # that the gradient reaches x through one matmul: one all-reduce, not three.
        qkv = jnp.einsum("btd,dngh->btngh", x_BTD, per_kv_head(w["wq"], w["wk"], w["wv"], 1))
        if self.bias != "none":
            qkv = qkv + per_kv_head(w["bq"], w["bk"], w["bv"], 0)[None, None]
        qkv = constrain(qkv, (*kv_axes[:3], None, "act_head_dim"))
        q = constrain(qkv[:, :, :, :group].reshape(*x_BTD.shape[:2], n_heads, head_dim), HEADS)
        k, v = (constrain(qkv[:, :, :, i], kv_axes) for i in (group, group + 1))
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, rope), apply_rope(k, rope), v

    def splash(self, q, k, v, window) -> jax.Array:
        """The splash kernel with this layer's window: its mask is static, so a stack whose layers
        differ in window runs the kernel of each (lax.switch on the layer's own)."""
        kernels = [
            partial(splash_attention, causal=self.causal, scale=self.scale, softcap=self.softcap, window=w)
            for w in (self.windows if window is not None else (0,))
        ]
        if len(kernels) == 1:
            return kernels[0](q, k, v)
        return jax.lax.switch(jnp.argmax(jnp.asarray(self.windows) == window), kernels, q, k, v)

    def output(self, out_BTNH: jax.Array) -> jax.Array:
        out = jnp.einsum("btnh,nhd->btd", out_BTNH, self.wo[...].astype(self.dtype))
        return constrain(out + self.bo[...].astype(self.dtype)[None, None] if self.bias == "all" else out, ACT)

    def __call__(self, x_BTD: jax.Array, rope, mask: jax.Array | None = None, window=None) -> jax.Array:
        """`mask` (batch, 1, seq, seq), True where a query may attend to a key, narrows the causal
        mask (to keep packed documents apart); so does a sliding `window` (a scalar, 0: none).
        Megatron's layout: q, k, v column-parallel and the output row-parallel over heads, so that
        tensor parallelism costs one all-reduce of (batch, seq, d_model) forward and one backward."""
        q, k, v = self.project(x_BTD, rope)
        if self.implementation == "splash":
            out = self.splash(q, k, v, window)
        elif self.implementation == "cudnn_estimate":
            out = fused_attention_stand_in(q, k, v, self.causal)
        elif self.implementation == "cudnn":
            out = jax.nn.dot_product_attention(
                q, k, v, mask=mask, scale=self.scale, is_causal=self.causal, implementation="cudnn"
            )
        else:
            if window is not None:
                positions = jnp.arange(x_BTD.shape[1])
                near = window_mask(positions, positions, window)
                mask = near if mask is None else mask & near
            out = grouped_attention(q, k, v, mask, self.causal, self.scale, self.softcap)
        return self.output(constrain(out, HEADS))

    def decode(
        self, x_BTD: jax.Array, rope, cache: tuple[jax.Array, jax.Array], start: jax.Array, window=None
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """Attention of the tokens x at positions start.. to themselves and everything before them
        (within a sliding `window`), whose keys and values `cache` (batch, length, kv_heads,
        head_dim) holds; x's are written into it. Positions after the last written one are masked,
        whatever the cache holds there."""
        q, k, v = self.project(x_BTD, rope, share_kv=False)
        cache = tuple(
            jax.lax.dynamic_update_slice_in_dim(c, new.astype(c.dtype), start, axis=1) for c, new in zip(cache, (k, v))
        )
        queries, keys = start + jnp.arange(x_BTD.shape[1]), jnp.arange(cache[0].shape[1])
        mask = (keys[None, :] <= queries[:, None])[None, None]
        if window is not None:
            mask = mask & window_mask(queries, keys, window)
        out = grouped_attention(q, *cache, mask, causal=False, scale=self.scale, softcap=self.softcap)
        return self.output(out), cache
