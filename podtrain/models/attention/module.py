"""The attention layer: projections to heads and back, rotary positions, the core the config
names (attention/cores.py, which attends across a split sequence too), a key/value cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from podtrain.models import lora, ops
from podtrain.models.attention import cores
from podtrain.models.attention.xla import grouped_attention
from podtrain.models.layers import ACT, HEADS, KV_HEADS, RMSNorm, param
from podtrain.models.rope import apply_rope
from podtrain.sharding import constrain, context_order, shards


class Attention(nnx.Module):
    """Grouped-query attention, causal unless told otherwise: n_kv_heads key/value heads shared by
    n_heads query heads of head_dim each. The options of the Hugging Face families: `bias` on the
    q, k and v projections ("qkv", Qwen2) or on all four ("all"), `qk_norm`, an RMSNorm over
    head_dim of each query and key head before the rotation (Qwen3, Gemma 3), the scores' `scale`
    (Gemma's query_pre_attn_scalar^-0.5) and their `softcap` (Gemma 2)."""

    adaptable = {"wq": 1, "wk": 1, "wv": 1, "wo": 2}  # for LoRA (models/lora.py): each weight's input axes

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
        self.core = cores.named(implementation)
        self.causal = causal

    def project(self, x_BTD: jax.Array, rope, share_kv: bool = True) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q, k and v of x, rotated by position. With `share_kv`, k/v heads that the head shards
        cannot split evenly get a copy per query head, so that q, k and v share one sharding
        (cuDNN's attention requires it; on the xla path it keeps tensor parallelism to one
        all-reduce per sub-layer, where uneven heads had the partitioner permute activations;
        copying replicated weights is local)."""
        names = ("wq", "wk", "wv") + (("bq", "bk", "bv") if self.bias != "none" else ())
        w = {name: getattr(self, name)[...].astype(self.dtype) for name in names}
        d, n_heads, head_dim = w["wq"].shape
        n_kv, kv_axes, copies = w["wk"].shape[1], KV_HEADS, 1
        if share_kv and n_kv % shards("act_heads", n_heads):
            copies = n_heads // n_kv
            for name in ("wk", "wv", "bk", "bv"):
                if name in w:  # heads: axis 1 of a weight, 0 of a bias
                    w[name] = jnp.repeat(w[name], copies, axis=1 if name[0] == "w" else 0)
            n_kv, kv_axes = n_heads, HEADS
        group = n_heads // n_kv

        def per_kv_head(q, k, v, heads: int):
            """q, k, v (head axis at `heads`) as (..., n_kv, group + 2, ...): a group's queries, its k, its v."""
            q = q.reshape(*q.shape[:heads], n_kv, group, *q.shape[heads + 1 :])
            return jnp.concatenate([q, jnp.expand_dims(k, heads + 1), jnp.expand_dims(v, heads + 1)], axis=heads + 1)

        # One projection for q, k and v, laid out per k/v head (the shards never split a group), so
        # that the gradient reaches x through one matmul: one all-reduce, not three.
        qkv = ops.dot("btd,dngh->btngh", x_BTD, per_kv_head(w["wq"], w["wk"], w["wv"], 1), self.dtype)
        if self.bias != "none":
            qkv = qkv + per_kv_head(w["bq"], w["bk"], w["bv"], 0)[None, None]
        qkv = constrain(qkv, (*kv_axes[:3], None, "act_head_dim"))
        q = constrain(qkv[:, :, :, :group].reshape(*x_BTD.shape[:2], n_heads, head_dim), HEADS)
        k, v = (constrain(qkv[:, :, :, i], kv_axes) for i in (group, group + 1))
        if lora.adapted(self):
            q = self.plus_low_rank(q, "wq", x_BTD, HEADS)
            k, v = (self.plus_low_rank(y, name, x_BTD, kv_axes, copies) for y, name in ((k, "wk"), (v, "wv")))
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, rope), apply_rope(k, rope), v

    def plus_low_rank(self, y: jax.Array, name: str, x: jax.Array, axes, copies: int = 1) -> jax.Array:
        """y plus the LoRA term of projection `name` of x, its heads repeated as the weight's were."""
        term = lora.low_rank(self, name, x, self.dtype)
        if term is None:
            return y
        return constrain(y + (jnp.repeat(term, copies, axis=2) if copies > 1 else term), axes)

    def output(self, out_BTNH: jax.Array) -> jax.Array:
        out = ops.dot("btnh,nhd->btd", out_BTNH, self.wo[...], self.dtype)
        if (term := lora.low_rank(self, "wo", out_BTNH, self.dtype)) is not None:
            out = out + term
        return constrain(out + self.bo[...].astype(self.dtype)[None, None] if self.bias == "all" else out, ACT)

    def __call__(
        self, x_BTD: jax.Array, rope, segments: jax.Array | None = None, window=None, positions=None
    ) -> jax.Array:
        """Causal self-attention of x, kept inside each segment of `segments` (batch, seq) if given
        (packed documents) and within a sliding `window` (a scalar, 0: none) if given. Tokens are
        in order, unless the sequence is split over devices: then they are in
        `sharding.balanced_order` and `positions` (batch, seq) say where each token is.
        Megatron's layout: q, k, v column-parallel and the output row-parallel over heads, so that
        tensor parallelism costs one all-reduce of (batch, seq, d_model) forward and one backward."""
        q, k, v = self.project(x_BTD, rope)
        out = self.core.run(
            q,
            k,
            v,
            causal=self.causal,
            scale=self.scale,
            softcap=self.softcap,
            segments=segments,
            window=window,
            windows=self.windows,
            order=context_order(x_BTD.shape[1]),
            positions=positions,
        )
        return self.output(constrain(out, HEADS))

    def decode(
        self, x_BTD: jax.Array, rope, cache: tuple[jax.Array, jax.Array], start: jax.Array, window=None, valid=None
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """Attention of the tokens x at positions start.. to themselves and everything before them
        (within a sliding `window`). `cache` (batch, slots, kv_heads, head_dim) is a ring: position
        p's keys and values live in slot p % slots, so a cache as long as the window serves any
        length when every layer slides. The first `valid` of x (default all; the rest padding)
        are written into it, the latest of them when they are more than its slots."""
        q, k, v = self.project(x_BTD, rope, share_kv=False)
        queries, places = ring_places(start, x_BTD.shape[1], cache[0].shape[1])
        keys, values = (jnp.concatenate([c, new.astype(c.dtype)], axis=1) for c, new in zip(cache, (k, v)))
        out = grouped_attention(
            q, keys, values, True, self.scale, self.softcap, window=window, q_index=queries, k_index=places
        )
        return self.output(out), tuple(ring_write(c, new, queries, valid) for c, new in zip(cache, (k, v)))


def counting(start, n: int) -> jax.Array:
    """start, start + 1, ..., start + n - 1: (n,) from one start, (batch, n) from one per sequence."""
    start = jnp.asarray(start)
    return start[..., None] + jnp.arange(n).reshape((1,) * start.ndim + (n,))


def ring_places(start: jax.Array, n: int, slots: int) -> tuple[jax.Array, jax.Array]:
    """(the positions of n new tokens from `start`, the position each key then holds): a ring
    cache of `slots` (position p in slot p % slots) followed by the new tokens. `start` is one
    position for the batch, or one per sequence (batch,): then both are per sequence."""
    queries = counting(start, n)
    # What each slot holds: the latest position before `start` that maps to it (negative: none yet).
    before = counting(jnp.asarray(start) - 1, 1)
    held = before - (before - jnp.arange(slots).reshape((1,) * (before.ndim - 1) + (slots,))) % slots
    return queries, jnp.concatenate([jnp.where(held >= 0, held, jnp.iinfo(jnp.int32).max), queries], axis=-1)


def ring_write(cache: jax.Array, new: jax.Array, queries: jax.Array, valid=None) -> jax.Array:
    """A ring cache (batch, slots, ...) with the first `valid` (default all; one count, or one per
    sequence) of `new` (batch, n, ...) at `queries` ((n,) or (batch, n)) written in, the latest of
    them when they are more than its slots."""
    (batch, n), slots = new.shape[:2], cache.shape[1]
    valid = counting(n if valid is None else valid, 1)
    index = jnp.arange(n).reshape((1,) * (valid.ndim - 1) + (n,))
    written = (index < valid) & (index >= valid - slots)
    to = jnp.broadcast_to(jnp.where(written, queries % slots, slots), (batch, n))  # out of range: dropped
    return cache.at[jnp.arange(batch)[:, None], to].set(new.astype(cache.dtype), mode="drop")
