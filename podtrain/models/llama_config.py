"""The Llama-style decoder's keys: its shape, RoPE and its scalings, and the options of the
Hugging Face families it computes (biases, q/k norms, sliding windows, soft-caps, Gemma's norms)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from podtrain.config.keys import key, same_key
from podtrain.config.schema import ModelConfig
from podtrain.errors import ConfigError
from podtrain.models.interface import LanguageModelConfig


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
    rope_mscale_all_dim: float = key(
        0.0,
        "yarn with attention_kind=mla: scores times (0.1 x this x ln(rope_factor) + 1)^2 (DeepSeek); 0: not",
        ">= 0",
    )
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
    attention_kind: Literal["gqa", "mla"] = key(
        "gqa",
        "gqa: grouped-query attention of n_heads / n_kv_heads heads of head_dim; mla: DeepSeek's multi-head latent "
        "attention (the q_lora_rank ... rope_interleave keys; n_kv_heads and head_dim unused), whose decode cache "
        "keeps kv_lora_rank + qk_rope_head_dim values a position per layer",
    )
    q_lora_rank: int = key(0, "mla: queries through a rank of this (DeepSeek-V3: 1536); 0: one projection", ">= 0")
    kv_lora_rank: int = key(512, "mla: width of the latent each position's keys and values come from", ">= 1")
    qk_nope_head_dim: int = key(128, "mla: each query and key head's dimensions without rotation", ">= 1")
    qk_rope_head_dim: int = key(64, "mla: each query head's rotated dimensions, and the one rotated key's", ">= 2")
    v_head_dim: int = key(128, "mla: width of each value head", ">= 1")
    rope_interleave: bool = key(True, "mla: the rotary pairs are interleaved (x0, x1), (x2, x3)... (DeepSeek-V3)")
    hf_type: str = key(
        "llama",
        "the Hugging Face model_type that `convert --to-hf` writes (`--from-hf` sets it), one the family computes",
    )

    @property
    def head_size(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def rotary_dims(self) -> int:
        """Each query's rotated dimensions (as transformers rounds a partial rotary fraction)."""
        return self.qk_rope_head_dim if self.attention_kind == "mla" else int(self.head_size * self.rotary_fraction)

    @property
    def latent_scale(self) -> float:
        """Latent attention's score scale: (nope + rope)^-0.5, times YaRN's mscale squared (DeepSeek's)."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        if self.rope_scaling != "yarn" or not self.rope_mscale_all_dim or self.rope_factor <= 1:
            return scale
        return scale * (0.1 * self.rope_mscale_all_dim * math.log(self.rope_factor) + 1) ** 2

    @property
    def attention_dims(self) -> int:
        """A head's query-key and value dimensions together: its FLOPs per key a query sees / 2."""
        if self.attention_kind == "mla":
            return self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim
        return 2 * self.head_size

    def stack_lengths(self) -> tuple[int, ...]:
        """The layers of each stack the model scans, bottom first (each a pipeline over mesh.stage)."""
        return (self.n_layers,)

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
        if self.attention_kind == "mla":
            self._validate_latent()
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"model.n_heads={self.n_heads} is not a multiple of model.n_kv_heads={self.n_kv_heads}; "
                "grouped-query attention shares each kv head by a whole number of query heads."
            )

    def _validate_latent(self) -> None:
        """Latent attention's rotary key is whole pairs, and it has none of grouped-query attention's options."""
        if self.qk_rope_head_dim % 2:
            raise ConfigError(
                f"model.qk_rope_head_dim={self.qk_rope_head_dim}: RoPE rotates pairs; give an even number."
            )
        lacks = {
            "attention_bias": "none",
            "qk_norm": False,
            "sliding_window": 0,
            "rotary_fraction": 1.0,
            "rope_local_theta": 0.0,
            "query_pre_attn_scalar": 0,
            "attn_softcap": 0.0,
        }
        if not_off := [f"model.{k}={getattr(self, k)}" for k, off in lacks.items() if getattr(self, k) != off]:
            raise ConfigError(
                f"model.attention_kind=mla has no {', '.join(not_off)}; leave them at their defaults, or use "
                "model.attention_kind=gqa."
            )
