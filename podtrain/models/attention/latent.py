"""Multi-head latent attention (MLA, DeepSeek-V2 and V3): every head's keys and values are made
from one small latent per position, so that a decode cache keeps kv_lora_rank + qk_rope_head_dim
values a position per layer instead of 2 x heads x head_dim.

    q:  x -> wq_a (-> q_lora_rank) -> RMSNorm -> wq_b (-> heads x (nope + rope)); or one wq
    kv: x -> wkv_a -> [latent (kv_lora_rank) -> RMSNorm | k_rope (qk_rope_head_dim)]
        latent -> wkv_b -> per head k_nope (qk_nope_head_dim) and v (v_head_dim)
    scores of [q_nope | rotated q_rope] with [k_nope | rotated k_rope, one key shared by all heads]

Training attends over the keys and values expanded per head (`grouped_attention`, or the splash
kernel on TPU; v of its own width in both). Decoding attends to the cache in the absorbed form:
wkv_b's key half is folded into each query (q_nope wkv_b_k: heads x kv_lora_rank) and its value
half applied after the softmax, so the cached [latent | rotated k_rope] is the single key head,
and its latent the single value head, of a multi-query attention. With `interleave` the rotary
pairs are (x0, x1), (x2, x3), ... (DeepSeek's layout, transformers' rope_interleave), gathered
into halves before Llama's rotation.

As in transformers' deepseek_v3, the two latent norms keep eps 1e-6 whatever the model's
norm_eps. Biases, q/k norms and soft-caps are not options of this attention.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from podtrain.models import ops
from podtrain.models.attention import cores
from podtrain.models.attention.module import ring_places, ring_write
from podtrain.models.attention.xla import grouped_attention
from podtrain.models.layers import ACT, HEADS, RMSNorm, param
from podtrain.models.rope import apply_rope
from podtrain.sharding import constrain

LATENT = ("act_batch", "act_seq", None)  # (batch, seq, latent): replicated over tensor, as small
LATENT_EPS = 1e-6  # transformers' DeepseekV3RMSNorm default, which its q_a and kv_a norms keep


class LatentAttention(nnx.Module):
    """Causal multi-head latent attention of n_heads heads: queries and keys of qk_nope_head_dim +
    qk_rope_head_dim, values of v_head_dim; `q_lora_rank` 0 projects queries in one matrix."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        q_lora_rank: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        std: float,
        out_std: float,
        dtype,
        rngs: nnx.Rngs,
        interleave: bool = True,
        scale: float | None = None,
        implementation: str = cores.PORTABLE,
    ):
        qk = qk_nope_head_dim + qk_rope_head_dim
        if q_lora_rank:
            self.wq_a = param(rngs, (d_model, q_lora_rank), ("embed", "latent"), std)
            self.q_a_norm = RMSNorm(q_lora_rank, LATENT_EPS, axis="latent")
            self.wq_b = param(rngs, (q_lora_rank, n_heads, qk), ("latent", "heads", "head_dim"), std)
        else:
            self.wq = param(rngs, (d_model, n_heads, qk), ("embed", "heads", "head_dim"), std)
        self.wkv_a = param(rngs, (d_model, kv_lora_rank + qk_rope_head_dim), ("embed", "latent"), std)
        self.kv_a_norm = RMSNorm(kv_lora_rank, LATENT_EPS, axis="latent")
        width = qk_nope_head_dim + v_head_dim  # per head: its key's unrotated part, then its value
        self.wkv_b = param(rngs, (kv_lora_rank, n_heads, width), ("latent", "heads", "head_dim"), std)
        self.wo = param(rngs, (n_heads, v_head_dim, d_model), ("heads", "head_dim", "embed"), out_std)
        self.dtype, self.interleave, self.scale = dtype, interleave, scale or qk**-0.5
        self.nope, self.rank, self.core = qk_nope_head_dim, kv_lora_rank, cores.named(implementation)

    def rotate(self, x: jax.Array, rope) -> jax.Array:
        """x (batch, seq, heads, rope dims) rotated by position, from interleaved pairs if so laid out."""
        if self.interleave:
            x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
        return apply_rope(x, rope)

    def queries(self, x_BTD: jax.Array, rope) -> tuple[jax.Array, jax.Array]:
        """(q_nope (B, T, H, nope), rotated q_rope (B, T, H, rope))."""
        if hasattr(self, "wq"):
            q = ops.dot("btd,dnh->btnh", x_BTD, self.wq[...], self.dtype)
        else:
            low = self.q_a_norm(constrain(ops.dot("btd,dc->btc", x_BTD, self.wq_a[...], self.dtype), LATENT))
            q = ops.dot("btc,cnh->btnh", low, self.wq_b[...], self.dtype)
        q = constrain(q, HEADS)
        return q[..., : self.nope], self.rotate(q[..., self.nope :], rope)

    def latent(self, x_BTD: jax.Array, rope) -> jax.Array:
        """(B, T, kv_lora_rank + rope): the normalised latent, then the rotated shared key: what a
        decode cache keeps of each position."""
        kv = constrain(ops.dot("btd,dc->btc", x_BTD, self.wkv_a[...], self.dtype), LATENT)
        k_rope = self.rotate(kv[:, :, None, self.rank :], rope)[:, :, 0]
        return jnp.concatenate([self.kv_a_norm(kv[..., : self.rank]), k_rope], axis=-1)

    def output(self, out_BTNV: jax.Array) -> jax.Array:
        return constrain(ops.dot("btnv,nvd->btd", out_BTNV, self.wo[...], self.dtype), ACT)

    def __call__(self, x_BTD: jax.Array, rope, segments=None, window=None, positions=None) -> jax.Array:
        """Causal attention of x to itself, within each segment of `segments` (batch, seq) if given;
        the rotary `rope` tables are at the tokens' positions already (`positions`, Attention's for
        a split sequence, is not needed: latent attention refuses one)."""
        q_nope, q_rope = self.queries(x_BTD, rope)
        c = self.latent(x_BTD, rope)
        kv = constrain(ops.dot("btc,cnh->btnh", c[..., : self.rank], self.wkv_b[...], self.dtype), HEADS)
        k_rope = jnp.broadcast_to(c[:, :, None, self.rank :], (*kv.shape[:3], c.shape[-1] - self.rank))
        q, k = jnp.concatenate([q_nope, q_rope], axis=-1), jnp.concatenate([kv[..., : self.nope], k_rope], axis=-1)
        out = self.core.run(q, k, kv[..., self.nope :], causal=True, scale=self.scale, segments=segments, window=window)
        return self.output(constrain(out, HEADS))

    def decode(self, x_BTD: jax.Array, rope, cache: tuple[jax.Array], start, window=None, valid=None):
        """As Attention.decode, over a cache of (batch, slots, kv_lora_rank + rope) latents: the
        absorbed form, one key/value head of the latents seen by every query head."""
        (latents,) = cache
        q_nope, q_rope = self.queries(x_BTD, rope)
        c = self.latent(x_BTD, rope)
        w_k, w_v = jnp.split(self.wkv_b[...], [self.nope], axis=-1)
        q = jnp.concatenate([ops.dot("btnh,cnh->btnc", q_nope, w_k, self.dtype), q_rope], axis=-1)
        queries, places = ring_places(start, x_BTD.shape[1], latents.shape[1])
        keys = jnp.concatenate([latents, c.astype(latents.dtype)], axis=1)[:, :, None]  # (B, S, 1, C)
        out = grouped_attention(
            q, keys, keys[..., : self.rank], True, self.scale, window=window, q_index=queries, k_index=places
        )
        out = ops.dot("btnc,cnv->btnv", out, w_v, self.dtype)
        return self.output(out), (ring_write(latents, c, queries, valid),)
