"""Building blocks shared by the models. Parameters name logical axes; no mesh appears here.

Precision policy: parameters are stored in float32 and cast to the compute dtype where used;
norms, softmax statistics and logits are computed in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str, ...], std: float) -> nnx.Param:
    """A float32 normal(0, std) parameter tagged with its logical axis names."""
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32), out_sharding=axes, eager_sharding=False)


def rms_norm(x: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) over the last axis, computed in float32; no learned scale."""
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32), out_sharding=("embed",), eager_sharding=False)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return (rms_norm(x, self.eps) * self.scale[...]).astype(x.dtype)


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos and sin of shape (seq_len, head_dim // 2) for rotary position embeddings."""
    inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, rope: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotate (batch, seq, heads, head_dim) by position, in the half-split layout of Llama."""
    cos, sin = (t[None, :, None, :] for t in rope)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query attention, causal unless told otherwise: n_kv_heads key/value heads shared by n_heads query heads."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, *, std: float, out_std: float, dtype, implementation: str, rngs: nnx.Rngs, causal: bool = True):
        head_dim = d_model // n_heads
        self.wq = param(rngs, (d_model, n_heads, head_dim), ("embed", "heads", "head_dim"), std)
        self.wk = param(rngs, (d_model, n_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), std)
        self.wv = param(rngs, (d_model, n_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), std)
        self.wo = param(rngs, (n_heads, head_dim, d_model), ("heads", "head_dim", "embed"), out_std)
        self.dtype = dtype
        self.implementation = None if implementation == "auto" else implementation
        self.causal = causal

    def __call__(self, x: jax.Array, rope) -> jax.Array:
        q, k, v = (jnp.einsum("btd,dnh->btnh", x, w[...].astype(self.dtype)) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = jax.nn.dot_product_attention(q, k, v, is_causal=self.causal, implementation=self.implementation)
        return jnp.einsum("btnh,nhd->btd", out, self.wo[...].astype(self.dtype))


class SwiGLU(nnx.Module):
    """silu(x W_gate) * (x W_up) W_down over the last axis, whose logical name is `axis`."""

    def __init__(self, d_model: int, d_ff: int, *, std: float, out_std: float, dtype, rngs: nnx.Rngs, axis: str = "embed"):
        self.w_gate = param(rngs, (d_model, d_ff), (axis, "mlp"), std)
        self.w_up = param(rngs, (d_model, d_ff), (axis, "mlp"), std)
        self.w_down = param(rngs, (d_ff, d_model), ("mlp", axis), out_std)
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        gate = jax.nn.silu(x @ self.w_gate[...].astype(self.dtype))
        return (gate * (x @ self.w_up[...].astype(self.dtype))) @ self.w_down[...].astype(self.dtype)


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
