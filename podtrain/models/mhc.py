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
Choices the paper leaves open follow MaxText's port: φ starts normal with std 1/sqrt(nC), α at
`model.alpha_init` (0.01), the static parts at zero (H_pre = 1/2, H_post = 1, H_res uniform).
The mixing coefficients and the mixing are computed in float32, as in the paper; the streams are
stored in the compute dtype between sub-layers.
"""

from __future__ import annotations

import itertools
import math
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


STREAMS = ("act_batch", "act_seq", "act_streams", "act_embed")  # the residual streams (batch, seq, n, d_model)


def sinkhorn(logits: jax.Array, iters: int) -> jax.Array:
    """The doubly stochastic matrix Sinkhorn-Knopp makes of exp(logits), over the last two axes."""

    def normalise(_, log_p):
        log_p = log_p - jax.nn.logsumexp(log_p, axis=-2, keepdims=True)  # columns
        return log_p - jax.nn.logsumexp(log_p, axis=-1, keepdims=True)  # rows

    return jnp.exp(jax.lax.fori_loop(0, iters, normalise, logits.astype(jnp.float32)))


def permutation_mixture(logits: jax.Array, n: int) -> jax.Array:
    """Σ_k softmax(logits)_k P_k over the n! permutation matrices: (..., n!) -> (..., n, n)."""
    perms = np.stack([np.eye(n, dtype=np.float32)[list(p)] for p in itertools.permutations(range(n))])
    return jnp.einsum("...k,kij->...ij", jax.nn.softmax(logits.astype(jnp.float32), axis=-1), perms)


@jax.checkpoint
def _project(flat: jax.Array, phi: jax.Array) -> jax.Array:
    """flat @ phi with phi gathered whole, so each batch shard computes its coefficients alone;
    rematerialised, so the backward gathers phi again instead of keeping it, as fsdp does."""
    return flat @ constrain(phi, ("act_embed", "act_streams"))


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
        """H_pre (b, t, n), H_post (b, t, n), H_res (b, t, n, n) in float32, for streams x (b, t, n, C)."""
        b, t, n, c = x.shape
        flat = self.norm(x.reshape(b, t, n * c)).astype(jnp.float32)
        gate = jnp.repeat(self.alpha[...], np.array(self.sizes), total_repeat_length=sum(self.sizes))
        pre, post, res = jnp.split(
            gate[None, None] * _project(flat, self.phi[...]) + self.bias[...][None, None],
            np.cumsum(self.sizes)[:2],
            axis=-1,
        )
        h_res = (
            permutation_mixture(res, n)
            if self.projection == "permutations"
            else sinkhorn(res.reshape(b, t, n, n), self.iters)
        )
        return jax.nn.sigmoid(pre), 2 * jax.nn.sigmoid(post), h_res

    def __call__(self, x: jax.Array, branch) -> jax.Array:
        """The coefficients and their products with the streams stay float32 (H_res doubly stochastic
        to float32 precision); the sum returns to the compute dtype."""
        h_pre, h_post, h_res = self.coefficients(x)
        y = branch(jnp.einsum("btn,btnc->btc", h_pre, x, preferred_element_type=jnp.float32).astype(x.dtype))
        mixed = jnp.einsum("btnm,btmc->btnc", h_res, x, preferred_element_type=jnp.float32) + jnp.einsum(
            "btn,btc->btnc", h_post, y, preferred_element_type=jnp.float32
        )
        return constrain(mixed.astype(x.dtype), STREAMS)


class MhcBlock(llama.Block):
    def __init__(self, cfg: MhcConfig, rngs: nnx.Rngs):
        super().__init__(cfg, rngs)
        self.attn_mix = StreamMixer(cfg, rngs)
        self.mlp_mix = StreamMixer(cfg, rngs)

    def residual(self, streams: jax.Array, attend) -> jax.Array:
        streams = self.attn_mix(constrain(streams, STREAMS), attend)
        return self.mlp_mix(streams, self.mlp_branch)


class Mhc(llama.Llama):
    """tokens (batch, seq) -> logits; the blocks carry (batch, seq, streams, d_model)."""

    block = MhcBlock

    def widen(self, x: jax.Array) -> jax.Array:
        return constrain(jnp.broadcast_to(x[:, :, None, :], (*x.shape[:2], self.cfg.streams, x.shape[-1])), STREAMS)

    def narrow(self, state: jax.Array) -> jax.Array:
        return state.sum(axis=2)


def flops_per_token(cfg: MhcConfig, n_params: int, seq_len: int) -> float:
    """Llama's count (φ is among the matmul weights) plus the stream mixing of 2 sub-layers per
    layer: H_res·x, H_pre·x and H_postᵀ·y, (n² + 2n)·C multiply-adds each, 6 FLOPs per training pass."""
    n = cfg.streams
    return llama.flops_per_token(cfg, n_params, seq_len) + 6 * 2 * cfg.n_layers * (n * n + 2 * n) * cfg.d_model


FAMILY = Family("mhc", MhcConfig, Mhc, flops_per_token, LanguageTask, llama.DEBUG)
