"""A Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU, scanned layers."""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from podtrain.config import ModelConfig, ranged
from podtrain.errors import ConfigError
from podtrain.models.layers import ACT, HEAD, TABLE, Attention, RMSNorm, SwiGLU, document_mask, embed_tokens, output_head, param, rope_tables, scan_layers, stacked
from podtrain.runtime.mesh import constrain


@dataclass
class LlamaConfig(ModelConfig):
    name: str = "llama"
    n_layers: int = ranged(4, ">= 1")
    n_kv_heads: int = ranged(2, ">= 1")  # grouped-query attention: n_heads / n_kv_heads query heads share a key/value head
    tie_embeddings: bool = True  # the output head is the embedding table, transposed
    init_std: float = ranged(0.02, "> 0")  # weights start normal with this std; residual outputs with std / sqrt(2 n_layers)

    def validate(self) -> None:
        super().validate()
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"model.n_heads={self.n_heads} is not a multiple of model.n_kv_heads={self.n_kv_heads}; grouped-query attention shares each kv head by a whole number of query heads.")


class Block(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.compute_dtype)
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, std=std, out_std=out_std, dtype=dtype, implementation=cfg.attention, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.d_ff, std=std, out_std=out_std, dtype=dtype, rngs=rngs)

    def attention_branch(self, x: jax.Array, rope, mask) -> jax.Array:
        return self.attn(self.attn_norm(x), rope, mask)

    def mlp_branch(self, x: jax.Array) -> jax.Array:
        return self.mlp(self.mlp_norm(x))

    def __call__(self, x: jax.Array, rope, mask) -> jax.Array:
        x = constrain(x, ACT)
        x = constrain(x + self.attention_branch(x, rope, mask), ACT)
        return constrain(x + self.mlp_branch(x), ACT)


class Llama(nnx.Module):
    """tokens (batch, seq) int32 -> logits (batch, seq, vocab) float32. With segment_ids (batch, seq),
    a token attends only to earlier tokens of its own segment (packed documents stay apart).

    Subclasses change the residual stream through `block`, `widen` and `narrow`.
    """

    block = Block

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), cfg.init_std)
        self.layers = stacked(cfg.n_layers, lambda r: self.block(cfg, r), rngs)
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if not cfg.tie_embeddings:
            self.head = param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg.init_std)

    def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        cfg = self.cfg
        dtype = jnp.dtype(cfg.compute_dtype)
        table = constrain(self.embed[...], TABLE)  # gathered once for the lookup and a tied head
        x = embed_tokens(table, tokens).astype(dtype)
        rope = rope_tables(tokens.shape[1], cfg.d_model // cfg.n_heads, cfg.rope_theta)
        mask = None if segment_ids is None else document_mask(segment_ids)
        x = self.narrow(scan_layers(self.layers, self.widen(x), rope, mask, remat=cfg.remat, unroll=cfg.scan_unroll))
        head = table.T if cfg.tie_embeddings else constrain(self.head[...], HEAD)
        return output_head(self.norm(x), head, dtype)

    def widen(self, x: jax.Array) -> jax.Array:
        """The embedded tokens as the residual state the blocks carry."""
        return x

    def narrow(self, state: jax.Array) -> jax.Array:
        """The residual state back to (batch, seq, d_model) for the final norm."""
        return state


def flops_per_token(cfg: LlamaConfig, n_params: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 per weight used in a matmul (forward 2, backward 4), plus
    attention scores and values, 12 * n_layers * d_model * seq_len (PaLM appendix B; the causal
    mask's saving is not subtracted). The embedding lookup is free unless tied to the head."""
    matmul_params = n_params - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model)
    return 6 * matmul_params + 12 * cfg.n_layers * cfg.d_model * seq_len
