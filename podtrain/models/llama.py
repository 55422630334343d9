"""A Llama-style decoder: RMSNorm, RoPE, grouped-query (or latent) attention, SwiGLU, scanned layers."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from podtrain.models.attention import Attention, LatentAttention
from podtrain.models.attention.module import counting
from podtrain.models.family import Family
from podtrain.models.layers import (
    ACT,
    HEAD,
    TABLE,
    RMSNorm,
    SwiGLU,
    embed_tokens,
    output_head,
    param,
    scan_layers,
    stacked,
)
from podtrain.models.llama_config import LlamaConfig
from podtrain.models.rope import Linear, Llama3, Yarn, rope_tables
from podtrain.sharding import constrain, context_order, positions_of, reordered


class Block(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.compute_dtype)
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, plus_one=cfg.norm_plus_one)
        self.attn = (
            latent_attention(cfg, std, out_std, dtype, rngs)
            if cfg.attention_kind == "mla"
            else Attention(
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
            )
        )
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, plus_one=cfg.norm_plus_one)
        self.mlp = self.make_mlp(cfg, std, out_std, dtype, rngs)
        if cfg.post_norms:
            self.attn_post_norm = RMSNorm(cfg.d_model, cfg.norm_eps, plus_one=cfg.norm_plus_one)
            self.mlp_post_norm = RMSNorm(cfg.d_model, cfg.norm_eps, plus_one=cfg.norm_plus_one)
        self.post_norms = cfg.post_norms

    def make_mlp(self, cfg: LlamaConfig, std: float, out_std: float, dtype, rngs: nnx.Rngs) -> nnx.Module:
        return SwiGLU(
            cfg.d_model, cfg.d_ff, std=std, out_std=out_std, dtype=dtype, rngs=rngs, activation=cfg.mlp_activation
        )

    def __call__(self, x: jax.Array, rope, segments, positions, window=None, mlp=None) -> jax.Array:
        """The block on x; `mlp` (of the normed stream) stands in for self.mlp where a subclass
        must see more of its output than the branch's."""
        rope = layer_rope(rope, window)
        return self.residual(
            x,
            lambda h: self.attn_out(self.attn(self.attn_norm(h), rope, segments, window, positions)),
            lambda h: self.mlp_branch(h, mlp or self.mlp),
        )

    def decode(self, x: jax.Array, rope, start, valid, cache, window=None, mlp=None) -> tuple[jax.Array, tuple]:
        """The block on new tokens whose earlier keys and values are in `cache`; returns it updated."""
        updated, rope = [], layer_rope(rope, window)

        def attend(h):
            out, new = self.attn.decode(self.attn_norm(h), rope, cache, start, window, valid)
            updated.append(new)
            return self.attn_out(out)

        return self.residual(x, attend, lambda h: self.mlp_branch(h, mlp or self.mlp)), updated[0]

    def residual(self, x: jax.Array, attend, mlp_branch) -> jax.Array:
        """The residual stream through attention (`attend` of a normed copy, masked as the caller
        needs) and the MLP branch; subclasses change how branches read and write the stream."""
        x = constrain(x, ACT)
        x = constrain(x + attend(x), ACT)
        return constrain(x + mlp_branch(x), ACT)

    def attn_out(self, out: jax.Array) -> jax.Array:
        """The attention branch's output as it joins the residual stream."""
        return self.attn_post_norm(out) if self.post_norms else out

    def mlp_branch(self, x: jax.Array, mlp) -> jax.Array:
        out = mlp(self.mlp_norm(x))
        return self.mlp_post_norm(out) if self.post_norms else out


def latent_attention(cfg: LlamaConfig, std: float, out_std: float, dtype, rngs: nnx.Rngs) -> LatentAttention:
    return LatentAttention(
        cfg.d_model,
        cfg.n_heads,
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        std=std,
        out_std=out_std,
        dtype=dtype,
        rngs=rngs,
        interleave=cfg.rope_interleave,
        scale=cfg.latent_scale,
        implementation=cfg.attention,
    )


# model.rope_scaling -> the stretch of the rotary frequencies it names (rope.rope_tables)
ROPE_SCALINGS = {
    "none": lambda cfg: None,
    "llama3": lambda cfg: Llama3(
        cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_max_len
    ),
    "linear": lambda cfg: Linear(cfg.rope_factor),
    "yarn": lambda cfg: Yarn(
        cfg.rope_factor,
        cfg.rope_original_max_len,
        cfg.rope_beta_fast,
        cfg.rope_beta_slow,
        cfg.rope_attention_factor,
        cfg.rope_truncate,
    ),
}


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
        self.build_layers(cfg, rngs)
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, plus_one=cfg.norm_plus_one)
        if not cfg.tie_embeddings:
            self.head = param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg.init_std)

    def build_layers(self, cfg: LlamaConfig, rngs: nnx.Rngs) -> None:
        self.layers = stacked(cfg.n_layers, lambda r: self.block(cfg, r), rngs)

    def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None, positions=None) -> jax.Array:
        table, x, _ = self.features(tokens, segment_ids, positions)
        return self.logits(table, x)

    def features(
        self, tokens: jax.Array, segment_ids: jax.Array | None = None, positions: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array, dict]:
        """The embedding table, the last block's output (batch, seq, d_model) and `auxiliary`'s
        terms: `logits` of the first two, whole or a slice of the positions at a time, are the
        model's output."""
        t = tokens.shape[1]
        if positions is None and (order := context_order(t)) is not None:  # the order a split sequence takes
            table, x, aux = self.features(*reordered(order, tokens, segment_ids, positions_of(tokens.shape)))
            return table, x[:, np.argsort(order)], aux
        table = constrain(self.embed[...], TABLE)  # gathered once for the lookup and a tied head
        rope = self.rope(tokens.shape[1] if positions is None else positions)
        x, reports = self.widen(self.embedded(table, tokens)), []
        for (stack, _), own in zip(self.stacks(), self.by_stack(self.per_layer())):
            x, report = scan_layers(
                stack,
                x,
                rope,
                segment_ids,
                positions,
                per_layer=own,
                remat=self.cfg.remat,
                unroll=self.cfg.scan_unroll,
                precision=self.cfg.matmul_precision,
                unbatched=(0,) if positions is None else (),  # the RoPE table of positions 0..t-1, for every row
            )
            reports.append(report)
        return table, self.narrow(x), self.auxiliary(reports)

    def stacks(self) -> list[tuple[nnx.Module, int]]:
        """(stacked layers, how many), bottom first, each scanned in turn: a family whose layers
        differ in kind (dense and MoE) keeps one stack per kind."""
        return [(self.layers, self.cfg.n_layers)]

    def by_stack(self, tree) -> list:
        """A tree of (n_layers, ...) arrays cut into each stack's layers."""
        ends = np.cumsum([n for _, n in self.stacks()])
        return [jax.tree.map(lambda a, e=end, n=n: a[e - n : e], tree) for (_, n), end in zip(self.stacks(), ends)]

    def auxiliary(self, reports: list) -> dict:
        """What the model adds to the loss ("loss") and logs beside it, from each stack's reports."""
        return {}

    def per_layer(self) -> tuple:
        """What differs between the stacked layers, one entry per layer: the sliding windows, if any."""
        windows = self.cfg.layer_windows()
        return () if windows is None else (jnp.asarray(windows, jnp.int32),)

    def decode(
        self, tokens: jax.Array, cache: tuple[jax.Array, jax.Array], start: jax.Array, valid=None
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """Logits of `tokens` (batch, n) at positions start..start+n-1, attending to the keys and
        values of earlier positions in `cache` (from `init_cache`); returns the cache with the
        first `valid` of theirs added (default all; the rest is padding); both one for the batch or
        one per sequence. A prompt is one call (prefill), then each new token one call of n=1."""
        table = constrain(self.embed[...], TABLE)
        rope = self.rope(counting(start, tokens.shape[1]))
        x, updated = self.widen(self.embedded(table, tokens)), []
        for (stack, _), layer_cache, own in zip(self.stacks(), self.by_stack(cache), self.by_stack(self.per_layer())):
            x, new = scan_layers(stack, x, rope, start, valid, per_layer=(layer_cache, *own), decode=True)
            updated.append(new)
        return self.logits(table, self.narrow(x)), jax.tree.map(lambda *c: jnp.concatenate(c), *updated)

    def init_cache(self, batch: int, length: int) -> tuple[jax.Array, ...]:
        """Empty keys and values for `length` positions: (layers, batch, slots, kv_heads, head_dim)
        each, a ring of slots; when every layer slides, as many slots as the widest window. Latent
        attention's is one array: (layers, batch, slots, kv_lora_rank + qk_rope_head_dim)."""
        cfg = self.cfg
        windows = cfg.layer_windows()
        slots = min(length, max(windows)) if windows and all(windows) else length
        if cfg.attention_kind == "mla":
            return (
                jnp.zeros((cfg.n_layers, batch, slots, cfg.kv_lora_rank + cfg.qk_rope_head_dim), cfg.compute_dtype),
            )
        shape = (cfg.n_layers, batch, slots, cfg.n_kv_heads, cfg.head_size)
        return jnp.zeros(shape, cfg.compute_dtype), jnp.zeros(shape, cfg.compute_dtype)

    def embedded(self, table: jax.Array, tokens: jax.Array) -> jax.Array:
        x = embed_tokens(table, tokens).astype(self.cfg.compute_dtype)
        # Gemma rounds sqrt(d_model) to the compute dtype first (bf16: 55.5 for 55.43 at d_model 3072)
        return x * jnp.asarray(math.sqrt(self.cfg.d_model), x.dtype) if self.cfg.scale_embedding else x

    def rope(self, positions):
        """cos and sin tables at `positions`; with model.rope_local_theta, {"full": ..., "sliding": ...}."""
        cfg = self.cfg
        rotary = cfg.rotary_dims
        full = rope_tables(positions, rotary, cfg.rope_theta, ROPE_SCALINGS[cfg.rope_scaling](cfg))
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


def flops_per_token(cfg: LlamaConfig, n_params: int, seq_len: int, per_weight: int = 6) -> float:
    """Training FLOPs per token: 6 per weight used in a matmul (forward 2, backward 4; `per_weight`=4
    for frozen weights, which get no gradient of their own), plus
    attention scores and values, 6 * n_heads * (query-key + value head dims) per key a query sees, counted causally
    (PaLM appendix B counts all seq_len keys; a causal query sees (seq_len + 1) / 2 on average, as
    MaxText counts), a sliding layer's at most its window. The embedding lookup is free unless
    tied to the head."""
    matmul_params = n_params - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model)
    keys = [causal_keys(seq_len, w) for w in cfg.layer_windows() or [0] * cfg.n_layers]
    return per_weight * matmul_params + 6 * cfg.n_heads * cfg.attention_dims * sum(keys)


def causal_keys(t: int, window: int = 0) -> float:
    """The keys a causal query of a t-token window sees, on average: query i sees min(i + 1, window)."""
    w = min(window or t, t)
    return (w * (w + 1) / 2 + (t - w) * w) / t


# The embedded tiny job's layer sizes: --use-small-model makes any Llama recipe this small.
DEBUG = {"d_model": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "d_ff": 384}
DEBUG |= {"kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32}  # latent attention's

FAMILY = Family(LlamaConfig, Llama, flops_per_token, "language", DEBUG)
