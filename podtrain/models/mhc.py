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
(`model.sinkhorn_iters`, 20 in the paper); here in float32, its first iteration in log space, so
it cannot overflow whatever the compute dtype, and recomputed in the backward.
`model.projection=permutations` is mHC-lite (arXiv 2601.05732): H_res = Σ_k softmax(H~_res)_k P_k
over the n! permutation matrices P_k, exactly doubly stochastic with no iterations, so φ_res and
b_res have n! outputs instead of n².

The token embedding is copied into the n streams; the streams are summed before the final norm.
The model carries them as a tuple of n arrays (batch, seq, C): each sub-layer writes its new
streams where they stay, never concatenated into one (batch, seq, n·C) array (a copy the TPU
compiler made of every mixer's output), and the coefficients' matmul over the flattened streams
is the sum of n matmuls, one per stream (its stream gradient elementwise on a TPU, matmuls elsewhere).
Choices the paper leaves open follow MaxText's port: φ starts normal with std 1/sqrt(nC), α at
`model.alpha_init` (0.01), the static parts at zero (H_pre = 1/2, H_post = 1, H_res uniform). The mixing is
computed in float32, as in the paper; the streams are stored in the compute dtype between sub-layers. Under
remat full a sub-layer keeps (`KEPT`) what its backward would otherwise recompute with a pass over all n
streams, or with the branch's output projection: the branch's input and output, the coefficients' projection
and 1/rms. RMSNorm(flat x)·φ is computed as (Σ_j x_j · diag(scale_j)φ_j) / rms(x), the division after the
projection as in the paper's kernels: equal in float32; in bfloat16 the normalised streams are no longer
rounded before the product, and φ·scale is rounded to bfloat16 for it.
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
from jax.ad_checkpoint import checkpoint_name

from podtrain.config.keys import key, same_key
from podtrain.config.schema import ModelConfig
from podtrain.errors import ConfigError
from podtrain.models import llama
from podtrain.models.family import Family
from podtrain.models.layers import KEPT, RMSNorm, param
from podtrain.sharding import constrain


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


STREAMS = ("act_batch", "act_seq", "act_embed")  # each residual stream: (batch, seq, d_model)
Streams = tuple[jax.Array, ...]  # the n residual streams


def sinkhorn(logits: jax.Array, iters: int) -> jax.Array:
    """The doubly stochastic matrix Sinkhorn-Knopp makes of exp(logits), over the last two axes.

    The n x n entries go first, the tokens last: an iteration is then elementwise across tokens,
    with sums over the leading axes, never reductions over (.., n, n) tiles that a TPU pads to
    (8, 128). The first iteration runs in float32 log space, so it cannot overflow whatever the
    compute dtype. It leaves columns that each summed to 1 divided by row sums of at most n, so
    every later column and row sum is at least 1/n (entries are at most 1): the later iterations
    divide the entries themselves, with no exp or log, and no sum can vanish."""
    log_k = jnp.moveaxis(logits.astype(jnp.float32), (-2, -1), (0, 1))
    log_p = log_k - jax.nn.logsumexp(log_k, axis=0, keepdims=True)
    first = jnp.exp(log_p - jax.nn.logsumexp(log_p, axis=1, keepdims=True))
    return jnp.moveaxis(_balance(first, iters - 1), (0, 1), (-2, -1))


def _normalise(p: jax.Array) -> jax.Array:
    """One Sinkhorn iteration on p (n, n, ...): columns, then rows, divided by their sums."""
    p = p / jnp.sum(p, axis=0, keepdims=True)
    return p / jnp.sum(p, axis=1, keepdims=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _balance(p: jax.Array, iters: int) -> jax.Array:
    """`iters` Sinkhorn iterations on p, a loop (unrolled, the chain of fused elementwise iterations
    grows the compiled code without bound)."""
    return jax.lax.fori_loop(0, iters, lambda _, p: _normalise(p), p)


def _balance_forward(p, iters):
    return jax.lax.scan(lambda p, _: (_normalise(p), p), p, None, length=iters)


def _balance_backward(iters, inputs, d_out):
    """Each iteration's gradient from its input alone (its sums recomputed): for a = p / c (column
    sums c) and q = a / r (row sums r), da = (dq - Σ_j dq q) / r and dp = (da - Σ_i da a) / c. Only
    the inputs are kept, one (n, n, ...) array per iteration; autodiff kept several and was slower
    (mhc_tiny's CPU step 1.08x)."""

    def step(d, p):
        c = jnp.sum(p, axis=0, keepdims=True)
        a = p / c
        r = jnp.sum(a, axis=1, keepdims=True)
        da = (d - jnp.sum(d * a, axis=1, keepdims=True) / r) / r
        return (da - jnp.sum(da * a, axis=0, keepdims=True)) / c, None

    return (jax.lax.scan(step, d_out, inputs, reverse=True)[0],)


_balance.defvjp(_balance_forward, _balance_backward)


def permutation_mixture(logits: jax.Array, n: int) -> jax.Array:
    """Σ_k softmax(logits)_k P_k over the n! permutation matrices: (..., n!) -> (..., n, n)."""
    perms = np.stack([np.eye(n, dtype=np.float32)[list(p)] for p in itertools.permutations(range(n))])
    return jnp.einsum("...k,kij->...ij", jax.nn.softmax(logits.astype(jnp.float32), axis=-1), perms)


def _project(xs: Streams, phi: jax.Array, scale: jax.Array) -> jax.Array:
    """flatten(xs) @ (diag(scale) phi), as Σ_j x_j @ (its rows of diag(scale) phi), in the streams'
    dtype, accumulated in float32, with phi and the norm's scale gathered whole, so each batch
    shard computes its coefficients alone; rematerialised, so the backward gathers them again
    instead of keeping them, as fsdp does. The checkpointed function is made anew at each trace:
    jax.checkpoint caches a function's trace, and the layout it pins depends on the mesh being
    traced for."""

    def project(xs, phi, scale):
        phi = constrain(phi, ("act_embed", "act_streams")) * constrain(scale, ("act_embed",))[:, None]
        c = xs[0].shape[-1]
        return _streams_matmul(xs, tuple(phi[j * c : (j + 1) * c].astype(xs[0].dtype) for j in range(len(xs))))

    return jax.checkpoint(project)(xs, phi, scale)


@jax.custom_vjp
def _streams_matmul(xs: Streams, ws: Streams) -> jax.Array:
    """Σ_j x_j @ w_j, accumulated in float32."""
    return functools.reduce(
        operator.add, [jnp.matmul(x, w, preferred_element_type=jnp.float32) for x, w in zip(xs, ws)]
    )


def _streams_matmul_fwd(xs, ws):
    return _streams_matmul(xs, ws), (xs, ws)


def _streams_matmul_bwd(saved, d):
    """dx_j = d @ w_jᵀ and dw_j = x_jᵀ d, in float32. On a TPU, dx_j is k multiply-adds per element
    (k = 2n + n² is small): elementwise, so the compiler fuses it with the streams' other gradient
    terms, where a matmul rooted one fusion per stream that read all n incoming stream gradients.
    Elsewhere matmuls are faster (on a CPU, 11x for dx at mhc_tiny's size)."""
    return jax.lax.platform_dependent(*saved, d, tpu=_streams_matmul_bwd_elementwise, default=_streams_matmul_bwd_dots)


def _streams_matmul_bwd_elementwise(xs, ws, d):
    k, lead = d.shape[-1], (1,) * (d.ndim - 1)
    rows = [w.T.astype(jnp.float32) for w in ws]  # (k, C): each term's weights contiguous
    dx = tuple(
        functools.reduce(operator.add, [d[..., i, None] * r[i].reshape(lead + (-1,)) for i in range(k)]).astype(x.dtype)
        for x, r in zip(xs, rows)
    )
    dw = tuple(jnp.einsum("...c,...k->ck", x.astype(jnp.float32), d).astype(w.dtype) for x, w in zip(xs, ws))
    return dx, dw


def _streams_matmul_bwd_dots(xs, ws, d):
    # dw_j as (dᵀ x_j)ᵀ, the tokens contracted in one 2-D matmul: 2.4x faster on a CPU than the einsum.
    flat = d.reshape(-1, d.shape[-1])
    dx = tuple(jnp.matmul(d, w.T.astype(jnp.float32)).astype(x.dtype) for x, w in zip(xs, ws))
    dw = tuple((flat.T @ x.reshape(flat.shape[0], -1).astype(jnp.float32)).T.astype(w.dtype) for x, w in zip(xs, ws))
    return dx, dw


_streams_matmul.defvjp(_streams_matmul_fwd, _streams_matmul_bwd)


def _streams(x: Streams) -> list[jax.Array]:
    """The streams in float32."""
    return [s.astype(jnp.float32) for s in x]


def _weighted(weights: jax.Array, vectors: list[jax.Array]) -> jax.Array:
    """Σ_j weights[..., j] vectors[j], elementwise over the vectors' last axis."""
    return functools.reduce(operator.add, [weights[..., j, None] * v for j, v in enumerate(vectors)])


def _dots(a: list[jax.Array], b: list[jax.Array]) -> jax.Array:
    """(..., len(a), len(b)): the per-token inner products of every a_i with every b_j."""
    return jnp.stack([jnp.stack([jnp.sum(ai * bj, axis=-1) for bj in b], axis=-1) for ai in a], axis=-2)


@jax.custom_vjp
def read_streams(h_pre: jax.Array, x: Streams) -> jax.Array:
    """H_pre · x: Σ_j h_pre[j] x_j (b, t, C) for h_pre (b, t, n) and the n streams x_j (b, t, C), in
    float32, returned in x's dtype; elementwise, so one pass over the streams."""
    return _weighted(h_pre, _streams(x)).astype(x[0].dtype)


def _read_forward(h_pre, x):
    return read_streams(h_pre, x), (h_pre, x)


def _read_backward(saved, d_out):
    """dx_j = h_pre[j] d_out and dh_pre[j] = <d_out, x_j>, in float32 inside one pass; only dx, in
    x's dtype, is written at the streams' size."""
    h_pre, x = saved
    d_out = d_out.astype(jnp.float32)
    dx = tuple((h_pre[..., j, None] * d_out).astype(x[0].dtype) for j in range(h_pre.shape[-1]))
    return _dots([d_out], _streams(x))[..., 0, :], dx


read_streams.defvjp(_read_forward, _read_backward)


@jax.custom_vjp
def write_streams(h_res: jax.Array, h_post: jax.Array, x: Streams, y: jax.Array) -> Streams:
    """H_res · x + H_postᵀ · y: stream i gets Σ_j h_res[i, j] x_j + h_post[i] y, for h_res (b, t, n, n),
    h_post (b, t, n), the n streams x_j (b, t, C), y (b, t, C). Products and sums in float32, the result
    in x's dtype; elementwise, so XLA reads the streams and y once and writes the new streams once."""
    xs, y = _streams(x), y.astype(jnp.float32)
    return tuple(
        (_weighted(h_res[..., i, :], xs) + h_post[..., i, None] * y).astype(x[0].dtype) for i in range(len(xs))
    )


def _write_forward(h_res, h_post, x, y):
    return write_streams(h_res, h_post, x, y), (h_res, h_post, x, y)


def _write_backward(saved, d_out):
    """dx_j = Σ_i h_res[i, j] d_i, dy = Σ_i h_post[i] d_i, dh_res[i, j] = <d_i, x_j>, dh_post[i] =
    <d_i, y>: the incoming gradient is widened to float32 inside the passes, never written so."""
    h_res, h_post, x, y = saved
    n = h_post.shape[-1]
    ds = _streams(d_out)
    dx = tuple(_weighted(h_res[..., :, j], ds).astype(x[0].dtype) for j in range(n))
    dh_res = _dots(ds, _streams(x))
    dh_post = _dots(ds, [y.astype(jnp.float32)])[..., 0]
    return dh_res, dh_post, dx, _weighted(h_post, ds).astype(y.dtype)


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

    def coefficients(self, x: Streams) -> tuple[jax.Array, jax.Array, jax.Array]:
        """H_pre (b, t, n), H_post (b, t, n), H_res (b, t, n, n) in float32, for the n streams x (b, t, C).

        RMSNorm(flat x) φ = (flat x (diag(scale) φ)) / rms(x): the division comes after the
        projection (as in the paper's kernels), so the normalised streams are never written."""
        b, t, n = *x[0].shape[:2], self.n
        squares = functools.reduce(operator.add, [jnp.sum(jnp.square(s.astype(jnp.float32)), axis=-1) for s in x])
        inv_rms = jax.lax.rsqrt(squares / (n * x[0].shape[-1]) + self.norm.eps)
        # Both kept under remat full (small per token; recomputing either reads all n streams).
        raw, inv_rms = checkpoint_name((_project(x, self.phi[...], self.norm.scale[...]), inv_rms), KEPT)
        projected = raw * inv_rms[..., None]
        gate = jnp.repeat(self.alpha[...], np.array(self.sizes), total_repeat_length=sum(self.sizes))
        pre, post, res = jnp.split(
            gate[None, None] * projected + self.bias[...][None, None], np.cumsum(self.sizes)[:2], axis=-1
        )
        h_res = (
            permutation_mixture(res, n)
            if self.projection == "permutations"
            # Recomputed in the backward: the iterations cost little; keeping each one's entries for
            # every layer copies them through the layer scan (mhc_tiny's CPU step 1.12x slower with
            # autodiff's backward, 1.02x with `_balance`'s, which keeps less).
            else jax.checkpoint(sinkhorn, static_argnums=1)(res.reshape(b, t, n, n), self.iters)
        )
        return jax.nn.sigmoid(pre), 2 * jax.nn.sigmoid(post), h_res

    def __call__(self, x: Streams, branch) -> Streams:
        """The coefficients and their products with the streams stay float32 (H_res doubly stochastic
        to float32 precision); the sums return to the compute dtype."""
        h_pre, h_post, h_res = self.coefficients(x)
        # Kept under remat full: the branch's input (one stream, where recomputing it reads all n)
        # and its output, which write_streams' backward needs and a plain residual's does not.
        y = checkpoint_name(branch(checkpoint_name(read_streams(h_pre, x), KEPT)), KEPT)
        return tuple(constrain(s, STREAMS) for s in write_streams(h_res, h_post, x, y))


class MhcBlock(llama.Block):
    def __init__(self, cfg: MhcConfig, rngs: nnx.Rngs):
        super().__init__(cfg, rngs)
        self.attn_mix = StreamMixer(cfg, rngs)
        self.mlp_mix = StreamMixer(cfg, rngs)

    def residual(self, streams: Streams, attend, mlp_branch) -> Streams:
        streams = self.attn_mix(tuple(constrain(s, STREAMS) for s in streams), attend)
        return self.mlp_mix(streams, mlp_branch)


class Mhc(llama.Llama):
    """tokens (batch, seq) -> logits; the blocks carry the streams as a tuple of (batch, seq, d_model)."""

    block = MhcBlock

    def widen(self, x: jax.Array) -> Streams:
        return tuple(constrain(x, STREAMS) for _ in range(self.cfg.streams))

    def narrow(self, state: Streams) -> jax.Array:
        return functools.reduce(operator.add, state)


def flops_per_token(cfg: MhcConfig, n_params: int, seq_len: int, per_weight: int = 6) -> float:
    """Llama's count (φ is among the matmul weights) plus the stream mixing of 2 sub-layers per
    layer: H_res·x, H_pre·x and H_postᵀ·y, (n² + 2n)·C multiply-adds each, 6 FLOPs per training pass."""
    n = cfg.streams
    return llama.flops_per_token(cfg, n_params, seq_len, per_weight) + 12 * cfg.n_layers * (n * n + 2 * n) * cfg.d_model


FAMILY = Family(MhcConfig, Mhc, flops_per_token, "language", llama.DEBUG)
