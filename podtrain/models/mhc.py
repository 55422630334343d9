"""mHC: the Llama decoder with its residual stream widened to n streams that are mixed around every
sub-layer (Manifold-Constrained Hyper-Connections, DeepSeek, arXiv 2512.24880; built on
Hyper-Connections, Zhu et al., arXiv 2409.19606).

For the streams x_l (n x C per token) and a sub-layer F (attention, or the MLP), with its pre-norm:

    x_{l+1} = H_res · x_l + H_postᵀ · F(H_pre · x_l)                              (paper eq. 3)

and the coefficients, each a static part b plus an input-dependent part gated by a scalar α:

    x' = RMSNorm(flatten(x_l))                                           1 x nC
    H~_pre = α_pre (x' φ_pre) + b_pre,  H~_post = α_post (x' φ_post) + b_post       1 x n
    H~_res = α_res mat(x' φ_res) + b_res                                            n x n
    H_pre = σ(H~_pre),  H_post = 2 σ(H~_post),  H_res = SinkhornKnopp(H~_res)       (eq. 8)

Sinkhorn-Knopp starts from exp(H~_res) and alternates column and row normalisation
(`model.sinkhorn_iters`, 20 in the paper); here it runs in float32 log space, so it cannot
overflow whatever the compute dtype. `model.projection=permutations` is mHC-lite
(arXiv 2601.05732): H_res = Σ_k softmax(H~_res)_k P_k over the n! permutation matrices P_k, exactly
doubly stochastic with no iterations, so φ_res and b_res have n! outputs instead of n².

The token embedding is copied into the n streams; the streams are summed before the final norm.
The model carries them flat, (batch, seq, n·C), the layout the coefficients' matmul reads.
Choices the paper leaves open follow MaxText's port: φ starts normal with std 1/sqrt(nC), α at
`model.alpha_init` (0.01), the static parts at zero (H_pre = 1/2, H_post = 1, H_res uniform).
The mixing coefficients and the mixing are computed in float32, as in the paper; the streams are
stored in the compute dtype between sub-layers.
RMSNorm(flat x)·φ is computed as (flat x · diag(scale)φ) / rms(x), the division after the
projection as in the paper's kernels: equal in float32; in bfloat16 the normalised streams are no
longer rounded before the product, and φ·scale is rounded to bfloat16 for it.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from dataclasses import dataclass
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from podtrain.config.schema import ModelConfig, key, same_key
from podtrain.errors import ConfigError
from podtrain.models import llama
from podtrain.models.family import Family
from podtrain.models.layers import RMSNorm, param
from podtrain.sharding import constrain
from podtrain.train.tasks.language import LanguageTask


@dataclass
class MhcConfig(llama.LlamaConfig):
    name: str = same_key(ModelConfig, "name", "mhc")
    streams: int = key(4, "parallel residual streams (n)", ">= 1")
    sinkhorn_iters: int = key(20, "Sinkhorn-Knopp iterations of the residual mixing's projection", ">= 1")
    projection: Literal["sinkhorn", "permutations"] = key(
        "sinkhorn", "sinkhorn (mHC), or a mix of all permutations (mHC-lite, streams <= 4)"
    )
    alpha_init: float = key(0.01, "initial gate of the input-dependent part of the mixing", "finite")

    def validate(self) -> None:
        super().validate()
        if self.projection == "permutations" and self.streams > 4:
            raise ConfigError(
                f"model.projection=permutations mixes all {self.streams}! permutations of the streams; "
                "use model.streams<=4 or projection=sinkhorn."
            )


STREAMS = ("act_batch", "act_seq", "act_embed")  # the residual streams, flat: (batch, seq, n·d_model)


def _logsumexp(values: list[jax.Array]) -> jax.Array:
    """log Σ exp over a list of equally shaped arrays, elementwise (max-subtracted, as jax.nn.logsumexp)."""
    top = jax.lax.stop_gradient(functools.reduce(jnp.maximum, values))
    return top + jnp.log(functools.reduce(operator.add, [jnp.exp(v - top) for v in values]))


def sinkhorn(logits: jax.Array, iters: int) -> jax.Array:
    """The doubly stochastic matrix Sinkhorn-Knopp makes of exp(logits), over the last two axes.

    In float32 log space, on the n² entries as separate arrays of the leading (token) shape, so
    that an iteration is elementwise across tokens: one pass over small per-token arrays, never
    reductions over (.., n, n) tiles that a TPU pads to (8, 128). The iterations stay a loop
    (unrolled, the chain of fused elementwise iterations grows the compiled code without bound)."""
    n = logits.shape[-1]

    def normalise(_, log_p):
        log_p = [log_p[i * n : (i + 1) * n] for i in range(n)]
        columns = [_logsumexp([log_p[i][j] for i in range(n)]) for j in range(n)]
        log_p = [[log_p[i][j] - columns[j] for j in range(n)] for i in range(n)]
        rows = [_logsumexp(log_p[i]) for i in range(n)]
        return tuple(log_p[i][j] - rows[i] for i in range(n) for j in range(n))

    entries = tuple(logits[..., i, j].astype(jnp.float32) for i in range(n) for j in range(n))
    log_p = jax.lax.fori_loop(0, iters, normalise, entries)
    return jnp.stack([jnp.exp(v) for v in log_p], axis=-1).reshape(logits.shape)


def permutation_mixture(logits: jax.Array, n: int) -> jax.Array:
    """Σ_k softmax(logits)_k P_k over the n! permutation matrices: (..., n!) -> (..., n, n)."""
    perms = np.stack([np.eye(n, dtype=np.float32)[list(p)] for p in itertools.permutations(range(n))])
    return jnp.einsum("...k,kij->...ij", jax.nn.softmax(logits.astype(jnp.float32), axis=-1), perms)


def _project(flat: jax.Array, phi: jax.Array, scale: jax.Array) -> jax.Array:
    """flat @ (diag(scale) phi) in flat's dtype, accumulated in float32, with phi and the norm's scale
    gathered whole, so each batch shard computes its coefficients alone; rematerialised, so the
    backward gathers them again instead of keeping them, as fsdp does. The checkpointed function is
    made anew at each trace: jax.checkpoint caches a function's trace, and the layout it pins
    depends on the mesh being traced for."""

    def project(flat, phi, scale):
        phi = constrain(phi, ("act_embed", "act_streams")) * constrain(scale, ("act_embed",))[:, None]
        return jnp.matmul(flat, phi.astype(flat.dtype), preferred_element_type=jnp.float32)

    return jax.checkpoint(project)(flat, phi, scale)


def _streams(x: jax.Array, n: int) -> list[jax.Array]:
    """The n streams of flat streams x (..., n·C), each (..., C), in float32."""
    c = x.shape[-1] // n
    return [x[..., j * c : (j + 1) * c].astype(jnp.float32) for j in range(n)]


def _weighted(weights: jax.Array, vectors: list[jax.Array]) -> jax.Array:
    """Σ_j weights[..., j] vectors[j], elementwise over the vectors' last axis."""
    return functools.reduce(operator.add, [weights[..., j, None] * v for j, v in enumerate(vectors)])


def _dots(a: list[jax.Array], b: list[jax.Array]) -> jax.Array:
    """(..., len(a), len(b)): the per-token inner products of every a_i with every b_j."""
    return jnp.stack([jnp.stack([jnp.sum(ai * bj, axis=-1) for bj in b], axis=-1) for ai in a], axis=-2)


@jax.custom_vjp
def read_streams(h_pre: jax.Array, x: jax.Array) -> jax.Array:
    """H_pre · x: Σ_j h_pre[j] x_j (b, t, C) for h_pre (b, t, n) and flat streams x (b, t, n·C), in
    float32, returned in x's dtype; elementwise, so one pass over the streams."""
    return _weighted(h_pre, _streams(x, h_pre.shape[-1])).astype(x.dtype)


def _read_forward(h_pre, x):
    return read_streams(h_pre, x), (h_pre, x)


def _read_backward(saved, d_out):
    """dx_j = h_pre[j] d_out and dh_pre[j] = <d_out, x_j>, in float32 inside one pass; only dx, in
    x's dtype, is written at the streams' size."""
    h_pre, x = saved
    d_out = d_out.astype(jnp.float32)
    dx = jnp.concatenate([h_pre[..., j, None] * d_out for j in range(h_pre.shape[-1])], axis=-1)
    return _dots([d_out], _streams(x, h_pre.shape[-1]))[..., 0, :], dx.astype(x.dtype)


read_streams.defvjp(_read_forward, _read_backward)


@jax.custom_vjp
def write_streams(h_res: jax.Array, h_post: jax.Array, x: jax.Array, y: jax.Array) -> jax.Array:
    """H_res · x + H_postᵀ · y: stream i gets Σ_j h_res[i, j] x_j + h_post[i] y, for h_res (b, t, n, n),
    h_post (b, t, n), flat streams x (b, t, n·C), y (b, t, C). Products and sums in float32, the result
    in x's dtype; elementwise, so XLA reads the streams and y once and writes the new streams once."""
    xs, y = _streams(x, h_post.shape[-1]), y.astype(jnp.float32)
    streams = [_weighted(h_res[..., i, :], xs) + h_post[..., i, None] * y for i in range(len(xs))]
    return jnp.concatenate(streams, axis=-1).astype(x.dtype)


def _write_forward(h_res, h_post, x, y):
    return write_streams(h_res, h_post, x, y), (h_res, h_post, x, y)


def _write_backward(saved, d_out):
    """dx_j = Σ_i h_res[i, j] d_i, dy = Σ_i h_post[i] d_i, dh_res[i, j] = <d_i, x_j>, dh_post[i] =
    <d_i, y>: the incoming gradient is widened to float32 inside the passes, never written so."""
    h_res, h_post, x, y = saved
    n = h_post.shape[-1]
    ds = _streams(d_out, n)
    dx = jnp.concatenate([_weighted(h_res[..., :, j], ds) for j in range(n)], axis=-1)
    dh_res = _dots(ds, _streams(x, n))
    dh_post = _dots(ds, [y.astype(jnp.float32)])[..., 0]
    return dh_res, dh_post, dx.astype(x.dtype), _weighted(h_post, ds).astype(y.dtype)


write_streams.defvjp(_write_forward, _write_backward)


class StreamMixer(nnx.Module):
    """The hyper-connection around one sub-layer: x <- H_res·x + H_postᵀ·F(H_pre·x)."""

    def __init__(self, cfg: MhcConfig, rngs: nnx.Rngs):
        n = cfg.streams
        self.n, self.iters, self.projection = n, cfg.sinkhorn_iters, cfg.projection
        n_res = math.factorial(n) if cfg.projection == "permutations" else n * n
        self.sizes = (n, n, n_res)  # pre, post, res
        self.norm = RMSNorm(n * cfg.d_model, cfg.norm_eps)
        self.phi = param(rngs, (n * cfg.d_model, sum(self.sizes)), ("embed", "streams"), 1 / math.sqrt(n * cfg.d_model))
        self.alpha = nnx.Param(
            jnp.full((3,), cfg.alpha_init, jnp.float32), out_sharding=("streams",), eager_sharding=False
        )
        self.bias = nnx.Param(
            jnp.zeros((sum(self.sizes),), jnp.float32), out_sharding=("streams",), eager_sharding=False
        )

    def coefficients(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """H_pre (b, t, n), H_post (b, t, n), H_res (b, t, n, n) in float32, for flat streams x (b, t, n·C).

        RMSNorm(flat x) φ = (flat x (diag(scale) φ)) / rms(x): the division comes after the
        projection (as in the paper's kernels), so the normalised streams are never written."""
        b, t, n = *x.shape[:2], self.n
        x32 = x.astype(jnp.float32)
        inv_rms = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1) + self.norm.eps)
        projected = _project(x, self.phi[...], self.norm.scale[...]) * inv_rms[..., None]
        gate = jnp.repeat(self.alpha[...], np.array(self.sizes), total_repeat_length=sum(self.sizes))
        pre, post, res = jnp.split(
            gate[None, None] * projected + self.bias[...][None, None], np.cumsum(self.sizes)[:2], axis=-1
        )
        h_res = (
            permutation_mixture(res, n)
            if self.projection == "permutations"
            else sinkhorn(res.reshape(b, t, n, n), self.iters)
        )
        return jax.nn.sigmoid(pre), 2 * jax.nn.sigmoid(post), h_res

    def __call__(self, x: jax.Array, branch) -> jax.Array:
        """The coefficients and their products with the streams stay float32 (H_res doubly stochastic
        to float32 precision); the sums return to the compute dtype."""
        h_pre, h_post, h_res = self.coefficients(x)
        y = branch(read_streams(h_pre, x))
        return constrain(write_streams(h_res, h_post, x, y), STREAMS)


class MhcBlock(llama.Block):
    def __init__(self, cfg: MhcConfig, rngs: nnx.Rngs):
        super().__init__(cfg, rngs)
        self.attn_mix = StreamMixer(cfg, rngs)
        self.mlp_mix = StreamMixer(cfg, rngs)

    def residual(self, streams: jax.Array, attend) -> jax.Array:
        streams = self.attn_mix(constrain(streams, STREAMS), attend)
        return self.mlp_mix(streams, self.mlp_branch)


class Mhc(llama.Llama):
    """tokens (batch, seq) -> logits; the blocks carry the streams flat, (batch, seq, streams·d_model)."""

    block = MhcBlock

    def widen(self, x: jax.Array) -> jax.Array:
        return constrain(jnp.tile(x, self.cfg.streams), STREAMS)

    def narrow(self, state: jax.Array) -> jax.Array:
        return state.reshape(*state.shape[:-1], self.cfg.streams, -1).sum(axis=-2)


def flops_per_token(cfg: MhcConfig, n_params: int, seq_len: int) -> float:
    """Llama's count (φ is among the matmul weights) plus the stream mixing of 2 sub-layers per
    layer: H_res·x, H_pre·x and H_postᵀ·y, (n² + 2n)·C multiply-adds each, 6 FLOPs per training pass."""
    n = cfg.streams
    return llama.flops_per_token(cfg, n_params, seq_len) + 6 * 2 * cfg.n_layers * (n * n + 2 * n) * cfg.d_model


FAMILY = Family("mhc", MhcConfig, Mhc, flops_per_token, LanguageTask, llama.DEBUG)
