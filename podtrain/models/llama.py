"""A Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU, scanned layers."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from podtrain.config.schema import ModelConfig, key, same_key
from podtrain.errors import ConfigError
from podtrain.models.attention import Attention
from podtrain.models.family import Family
from podtrain.models.interface import LanguageModelConfig
from podtrain.models.layers import (
    ACT,
    HEAD,
    TABLE,
    RMSNorm,
    SwiGLU,
    Yarn,
    embed_tokens,
    output_head,
    param,
    rope_tables,
    scan_layers,
    stacked,
)
from podtrain.sharding import constrain, context_order
from podtrain.train.tasks.language import LanguageTask


@dataclass
class LlamaConfig(LanguageModelConfig):
    name: str = same_key(ModelConfig, "name", "llama")
    rope_theta: float = key(10000.0, "base of the rotary position embedding's wavelengths", "> 0")
    n_layers: int = key(4, "decoder layers, stacked and scanned", ">= 1")
    n_kv_heads: int = key(2, "key/value heads: n_heads / n_kv_heads query heads share one (grouped-query)", ">= 1")
    tie_embeddings: bool = key(True, "the output head is the embedding table, transposed")
    init_std: float = key(0.02, "std of the initial weights; residual outputs get std / sqrt(2 n_layers)", "> 0")
    rope_scaling: Literal["none", "llama3", "linear", "yarn"] = key(
        "none",
        "llama3: Llama 3's stretch of the long rotary wavelengths; yarn: YaRN's (Qwen's long context, DeepSeek-V3); "
        "linear: positions divided by rope_factor (of the layers that attend to everything, if rope_local_theta is "
        "set); each with the rope_ keys below",
    )
    rope_factor: float = key(8.0, "llama3, yarn and linear scaling: how far the wavelengths are stretched", ">= 1")
    rope_low_freq_factor: float = key(1.0, "llama3 scaling: wavelengths above max_len / this are stretched", "> 0")
    rope_high_freq_factor: float = key(4.0, "llama3 scaling: wavelengths below max_len / this are kept", "> 0")
    rope_original_max_len: int = key(8192, "llama3 and yarn scaling: the context length before the stretch", ">= 1")
    rope_beta_fast: float = key(32.0, "yarn: wavelengths of more than this many turns in the context are kept", "> 0")
    rope_beta_slow: float = key(1.0, "yarn: wavelengths of fewer turns than this are stretched", "> 0")
    rope_attention_factor: float = key(
        0.0, "yarn: cos and sin are scaled by this; 0: 0.1 ln(rope_factor) + 1, as YaRN's paper", ">= 0"
    )
    rope_truncate: bool = key(True, "yarn: the ramp's ends rounded to whole dimensions (as transformers)")
    head_dim: int = key(0, "width of each attention head; 0: d_model / n_heads", ">= 0")
    attention_bias: Literal["none", "qkv", "all"] = key(
        "none", "biases of the attention projections: none, on q/k/v (Qwen2), or on q/k/v and the output"
    )
    qk_norm: bool = key(False, "an RMSNorm over each query and key head before the rotation (Qwen3)")
    sliding_window: int = key(
        0, "positions a query attends to, itself included, in the layers that slide (Mistral); 0: all", ">= 0"
    )
    full_attention_layers: list[int] = key(
        [], "layers (from 0) that attend to every earlier position whatever sliding_window (Qwen2's first ones)"
    )
    rotary_fraction: float = key(
        1.0, "the share of each head's dimensions that RoPE rotates (Phi-3's partial rotary)", "(0, 1]"
    )
    rope_local_theta: float = key(0.0, "RoPE base of the sliding layers (Gemma 3: 10,000); 0: rope_theta", ">= 0")
    query_pre_attn_scalar: int = key(0, "attention scores are scaled by this^-0.5 (Gemma); 0: head_dim", ">= 0")
    attn_softcap: float = key(0.0, "attention scores bounded to (-c, c) as c tanh(s / c) (Gemma 2: 50); 0: off", ">= 0")
    final_softcap: float = key(0.0, "logits bounded the same way (Gemma 2: 30); 0: off", ">= 0")
    norm_plus_one: bool = key(False, "RMSNorms scale by 1 + w, w starting at 0 (Gemma)")
    scale_embedding: bool = key(False, "the embedding times sqrt(d_model), rounded to the compute dtype (Gemma)")
    post_norms: bool = key(False, "an RMSNorm on each branch's output before the residual add (Gemma 2 and 3)")
    mlp_activation: Literal["silu", "gelu_tanh"] = key(
        "silu", "the gated MLP's activation: silu (SwiGLU) or gelu_tanh (GeGLU, Gemma)"
    )
    context_attention: Literal["all_gather", "ring"] = key(
        "all_gather",
        "with mesh.context > 1: all_gather: every shard's keys and values gathered per layer; ring: passed "
        "round a ring of the context shards, one shard's at a time (less memory, more steps)",
    )
    hf_type: Literal["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3"] = key(
        "llama", "the Hugging Face model_type that `convert --to-hf` writes (`--from-hf` sets it)"
    )

    @property
    def head_size(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    def layer_windows(self) -> list[int] | None:
        """Each layer's sliding window (0: it sees every earlier position), or None if none slides."""
        if not self.sliding_window:
            return None
        return [0 if i in self.full_attention_layers else self.sliding_window for i in range(self.n_layers)]

    def validate(self) -> None:
        super().validate()
        if int(self.head_size * self.rotary_fraction) % 2:
            raise ConfigError(
                f"model.rotary_fraction={self.rotary_fraction} rotates {int(self.head_size * self.rotary_fraction)} of "
                f"each head's {self.head_size} dimensions; RoPE rotates pairs: pick a fraction giving an even number."
            )
        if self.rope_local_theta and not self.sliding_window:
            raise ConfigError(
                f"model.rope_local_theta={self.rope_local_theta} is the RoPE base of the sliding layers, and "
                "model.sliding_window=0 makes none; set a window, or rope_local_theta=0."
            )
        if bad := [i for i in self.full_attention_layers if not 0 <= i < self.n_layers]:
            raise ConfigError(
                f"model.full_attention_layers names layers {bad}, outside 0..{self.n_layers - 1} (model.n_layers="
                f"{self.n_layers}); list layers of the model."
            )
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"model.n_heads={self.n_heads} is not a multiple of model.n_kv_heads={self.n_kv_heads}; "
                "grouped-query attention shares each kv head by a whole number of query heads."
            )


class Block(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.compute_dtype)
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, plus_one=cfg.norm_plus_one)
        self.attn = Attention(
            cfg.d_model,
            cfg.n_heads,
            cfg.n_kv_heads,
            std=std,
            out_std=out_std,
            dtype=dtype,
            implementation=cfg.attention,
            rngs=rngs,
            head_dim=cfg.head_size,
            bias=cfg.attention_bias,
            qk_norm=cfg.qk_norm,
            norm_eps=cfg.norm_eps,
            norm_plus_one=cfg.norm_plus_one,
            scale=cfg.query_pre_attn_scalar**-0.5 if cfg.query_pre_attn_scalar else None,
            softcap=cfg.attn_softcap,
            windows=tuple(sorted(set(cfg.layer_windows() or []))),
            context=cfg.context_attention,
        )
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, plus_one=cfg.norm_plus_one)
        self.mlp = SwiGLU(
            cfg.d_model, cfg.d_ff, std=std, out_std=out_std, dtype=dtype, rngs=rngs, activation=cfg.mlp_activation
        )
        if cfg.post_norms:
            self.attn_post_norm = RMSNorm(cfg.d_model, cfg.norm_eps, plus_one=cfg.norm_plus_one)
            self.mlp_post_norm = RMSNorm(cfg.d_model, cfg.norm_eps, plus_one=cfg.norm_plus_one)
        self.post_norms = cfg.post_norms

    def __call__(self, x: jax.Array, rope, segments, positions, window=None) -> jax.Array:
        rope = layer_rope(rope, window)
        return self.residual(
            x, lambda h: self.attn_out(self.attn(self.attn_norm(h), rope, segments, window, positions))
        )

    def decode(self, x: jax.Array, rope, cache, start, valid, window=None) -> tuple[jax.Array, tuple]:
        """The block on new tokens whose earlier keys and values are in `cache`; returns it updated."""
        updated, rope = [], layer_rope(rope, window)

        def attend(h):
            out, new = self.attn.decode(self.attn_norm(h), rope, cache, start, window, valid)
            updated.append(new)
            return self.attn_out(out)

        return self.residual(x, attend), updated[0]

    def residual(self, x: jax.Array, attend) -> jax.Array:
        """The residual stream through attention (`attend` of a normed copy, masked as the caller
        needs) and the MLP; subclasses change how branches read and write the stream."""
        x = constrain(x, ACT)
        x = constrain(x + attend(x), ACT)
        return constrain(x + self.mlp_branch(x), ACT)

    def attn_out(self, out: jax.Array) -> jax.Array:
        """The attention branch's output as it joins the residual stream."""
        return self.attn_post_norm(out) if self.post_norms else out

    def mlp_branch(self, x: jax.Array) -> jax.Array:
        out = self.mlp(self.mlp_norm(x))
        return self.mlp_post_norm(out) if self.post_norms else out


def layer_rope(rope, window):
    """A layer's rotary tables: `rope` itself, or of {"full": ..., "sliding": ...} (model.rope_local_theta)
    the sliding layers' when this layer's window is set."""
    if not isinstance(rope, dict):
        return rope
    if window is None:  # no layer slides
        return rope["full"]
    return jax.tree.map(lambda full, sliding: jnp.where(window > 0, sliding, full), rope["full"], rope["sliding"])


class Llama(nnx.Module):
    """A LanguageModel (models/interface.py): tokens (batch, seq) int32 -> logits (batch, seq,
    vocab) float32. With segment_ids (batch, seq), a token attends only to earlier tokens of its
    own segment (packed documents stay apart); `positions` (batch, seq) are its rotary positions
    (default 0, 1, ...).

    Subclasses change the residual stream through `block`, `widen` and `narrow`.
    """

    block = Block

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), cfg.init_std)
        self.layers = stacked(cfg.n_layers, lambda r: self.block(cfg, r), rngs)
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, plus_one=cfg.norm_plus_one)
        if not cfg.tie_embeddings:
            self.head = param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg.init_std)

    def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None, positions=None) -> jax.Array:
        return self.logits(*self.features(tokens, segment_ids, positions))

    def features(
        self, tokens: jax.Array, segment_ids: jax.Array | None = None, positions: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """The embedding table and the last block's output (batch, seq, d_model): `logits` of the
        two, whole or a slice of the positions at a time, are the model's output."""
        t = tokens.shape[1]
        if positions is None and (order := context_order(t)) is not None:  # the order a split sequence takes
            segments = None if segment_ids is None else segment_ids[:, order]
            table, x = self.features(tokens[:, order], segments, jnp.broadcast_to(jnp.asarray(order), tokens.shape))
            return table, x[:, np.argsort(order)]
        table = constrain(self.embed[...], TABLE)  # gathered once for the lookup and a tied head
        rope = self.rope(tokens.shape[1] if positions is None else positions)
        x = scan_layers(
            self.layers,
            self.widen(self.embedded(table, tokens)),
            rope,
            segment_ids,
            positions,
            per_layer=self.per_layer(),
            remat=self.cfg.remat,
            unroll=self.cfg.scan_unroll,
        )
        return table, self.narrow(x)

    def per_layer(self) -> tuple:
        """What differs between the stacked layers, one entry per layer: the sliding windows, if any."""
        windows = self.cfg.layer_windows()
        return () if windows is None else (jnp.asarray(windows, jnp.int32),)

    def decode(
        self, tokens: jax.Array, cache: tuple[jax.Array, jax.Array], start: jax.Array, valid=None
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """Logits of `tokens` (batch, n) at positions start..start+n-1, attending to the keys and
        values of earlier positions in `cache` (from `init_cache`); returns the cache with the
        first `valid` of theirs added (default all; the rest is padding). A prompt is one call
        (prefill), then each new token one call of n=1."""
        table = constrain(self.embed[...], TABLE)
        rope = self.rope(start + jnp.arange(tokens.shape[1]))
        graphdef, state = nnx.split(self.layers)

        def body(h, layer):
            layer_state, layer_cache, own = layer
            return nnx.merge(graphdef, layer_state).decode(h, rope, layer_cache, start, valid, *own)

        x, cache = jax.lax.scan(body, self.widen(self.embedded(table, tokens)), (state, cache, self.per_layer()))
        return self.logits(table, self.narrow(x)), cache

    def init_cache(self, batch: int, length: int) -> tuple[jax.Array, jax.Array]:
        """Empty keys and values for `length` positions: (layers, batch, slots, kv_heads, head_dim)
        each, a ring of slots; when every layer slides, as many slots as the widest window."""
        cfg = self.cfg
        windows = cfg.layer_windows()
        slots = min(length, max(windows)) if windows and all(windows) else length
        shape = (cfg.n_layers, batch, slots, cfg.n_kv_heads, cfg.head_size)
        return jnp.zeros(shape, cfg.compute_dtype), jnp.zeros(shape, cfg.compute_dtype)

    def embedded(self, table: jax.Array, tokens: jax.Array) -> jax.Array:
        x = embed_tokens(table, tokens).astype(self.cfg.compute_dtype)
        # Gemma rounds sqrt(d_model) to the compute dtype first (bf16: 55.5 for 55.43 at d_model 3072)
        return x * jnp.asarray(math.sqrt(self.cfg.d_model), x.dtype) if self.cfg.scale_embedding else x

    def rope(self, positions):
        """cos and sin tables at `positions`; with model.rope_local_theta, {"full": ..., "sliding": ...}."""
        cfg = self.cfg
        llama3 = (
            (cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_max_len)
            if cfg.rope_scaling == "llama3"
            else None
        )
        linear = cfg.rope_factor if cfg.rope_scaling == "linear" else None
        yarn = (
            Yarn(
                cfg.rope_factor,
                cfg.rope_original_max_len,
                cfg.rope_beta_fast,
                cfg.rope_beta_slow,
                cfg.rope_attention_factor,
                cfg.rope_truncate,
            )
            if cfg.rope_scaling == "yarn"
            else None
        )
        rotary = int(cfg.head_size * cfg.rotary_fraction)  # as transformers rounds it
        full = rope_tables(positions, rotary, cfg.rope_theta, llama3, linear, yarn)
        if not cfg.rope_local_theta:
            return full
        return {"full": full, "sliding": rope_tables(positions, rotary, cfg.rope_local_theta)}

    def logits(self, table: jax.Array, x: jax.Array) -> jax.Array:
        head = table.T if self.cfg.tie_embeddings else constrain(self.head[...], HEAD)
        logits = output_head(self.norm(x), head, jnp.dtype(self.cfg.compute_dtype))
        cap = self.cfg.final_softcap
        return cap * jnp.tanh(logits / cap) if cap else logits

    def widen(self, x: jax.Array) -> jax.Array:
        """The embedded tokens as the residual state the blocks carry."""
        return x

    def narrow(self, state: jax.Array) -> jax.Array:
        """The residual state back to (batch, seq, d_model) for the final norm."""
        return state


def flops_per_token(cfg: LlamaConfig, n_params: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 per weight used in a matmul (forward 2, backward 4), plus
    attention scores and values, 12 * n_heads * head_dim per key a query sees, counted causally
    (PaLM appendix B counts all seq_len keys; a causal query sees (seq_len + 1) / 2 on average, as
    MaxText counts), a sliding layer's at most its window. The embedding lookup is free unless
    tied to the head."""
    matmul_params = n_params - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model)
    keys = [causal_keys(seq_len, w) for w in cfg.layer_windows() or [0] * cfg.n_layers]
    return 6 * matmul_params + 12 * cfg.n_heads * cfg.head_size * sum(keys)


def causal_keys(t: int, window: int = 0) -> float:
    """The keys a causal query of a t-token window sees, on average: query i sees min(i + 1, window)."""
    w = min(window or t, t)
    return (w * (w + 1) / 2 + (t - w) * w) / t


# The embedded tiny job's layer sizes: --use-small-model makes any Llama recipe this small.
DEBUG = {"d_model": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "d_ff": 384}

FAMILY = Family("llama", LlamaConfig, Llama, flops_per_token, LanguageTask, DEBUG)
