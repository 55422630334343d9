"""Recursive reasoning models for puzzles: HRM and TRM, one forward pass = one supervision segment.

Both read a puzzle (batch, seq) of tokens plus a puzzle id, and carry a latent state from one
segment to the next; the training layer runs segments (deep supervision, ACT) and detaches the
carry between them. The input x is the token embedding scaled by sqrt(d), behind `puzzle_emb_len`
positions whose first holds the learned (zero-initialised) puzzle embedding.

HRM (Wang et al. 2025, sapientinc/HRM): a low-level module L and a high-level module H, each a
stack of post-norm transformer blocks that first add their input injection:
    repeat H_cycles:  (repeat L_cycles: z_L <- L(z_L, z_H + x));  z_H <- H(z_H, z_L)
Only the last L update and the last H update get gradients (the one-step gradient).

TRM (Jolicoeur-Martineau 2025, SamsungSAILMontreal/TinyRecursiveModels): one network for both
updates, with y (the answer) in z_H's role and z (the latent) in z_L's:
    repeat H_cycles:  (repeat L_cycles: z <- net(z, y + x));  y <- net(y, z)
and all but the last of the H_cycles run without gradients. `mlp_t` replaces attention by a
SwiGLU across the sequence axis (the Sudoku variant, no positional encoding).

Outputs: the carry (detached), logits of the puzzle cells read from z_H / y, and the Q-head's
(halt, continue) logits read from position 0 (weight 0, bias -5 at init).

Departures from the references: linear layers start normal with std 1/sqrt(fan_in) rather
than truncated normal; the initial states z_H, z_L are drawn from a fixed key at each call
(truncated normal, std 1) instead of being stored as buffers, which is the same constant
without a checkpoint entry; the puzzle embedding is an ordinary parameter, trained by the main
optimizer, or by the references' sign-SGD on the rows a step reaches with train.puzzle_emb_lr > 0
(podtrain.program.optim); parameter counts leave it out as the references' counts do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import jax
import jax.numpy as jnp
from flax import nnx

from podtrain.config.keys import key, same_key
from podtrain.config.schema import ModelConfig
from podtrain.models.attention import Attention
from podtrain.models.family import Family
from podtrain.models.layers import (
    ACT,
    HEAD,
    TABLE,
    SwiGLU,
    embed_tokens,
    output_head,
    param,
    rms_norm_keeping_input,
    scan_layers,
    stacked,
)
from podtrain.models.rope import rope_tables
from podtrain.sharding import constrain

INIT_KEY = 1234  # the fixed draw of the initial states


@dataclass
class RecursiveConfig(ModelConfig):
    """HRM and TRM: the recursion under the names of their reference configs, and Sudoku's
    vocabulary and length as defaults."""

    vocab_size: int = same_key(ModelConfig, "vocab_size", 11)
    max_seq_len: int = same_key(ModelConfig, "max_seq_len", 81)
    rope_theta: float = key(10000.0, "base of the rotary position embedding's wavelengths (attention blocks)", "> 0")
    H_cycles: int = key(3, "high-level cycles per supervision segment", ">= 1")
    L_cycles: int = key(6, "low-level cycles per high-level cycle", ">= 1")
    L_layers: int = key(2, "blocks of the low-level module (TRM: of its one network)", ">= 1")
    halt_max_steps: int = key(16, "supervision segments before a puzzle must halt (ACT)", ">= 1")
    halt_exploration_prob: float = key(0.1, "chance that a puzzle may not halt before a random step", "[0, 1]")
    no_ACT_continue: bool = key(
        True, "halt when q_halt > 0 (TRM); false: when q_halt > q_continue, with q_continue's loss (HRM)"
    )
    puzzle_emb_len: int = key(16, "sequence positions in front of the puzzle for its learned embedding", ">= 1")
    mlp_kernel: Literal["auto", "xla", "pallas"] = key(
        "auto", "the MLPs: pallas keeps their hidden layer in VMEM (TPU, no tensor parallelism); auto: pallas on TPU"
    )
    num_puzzle_ids: int = key(1, "puzzle embeddings (one shared embedding for Sudoku)", ">= 1")
    mlp_t: ClassVar[bool] = False  # attention in every block; TRM makes it a key


@dataclass
class HrmConfig(RecursiveConfig):
    name: str = same_key(ModelConfig, "name", "hrm")
    H_cycles: int = same_key(RecursiveConfig, "H_cycles", 2)
    L_cycles: int = same_key(RecursiveConfig, "L_cycles", 2)
    H_layers: int = key(4, "blocks of the high-level module", ">= 1")
    L_layers: int = same_key(RecursiveConfig, "L_layers", 4)
    no_ACT_continue: bool = same_key(RecursiveConfig, "no_ACT_continue", False)
    puzzle_emb_len: int = same_key(RecursiveConfig, "puzzle_emb_len", 1)


@dataclass
class TrmConfig(RecursiveConfig):
    name: str = same_key(ModelConfig, "name", "trm")
    mlp_t: bool = key(False, "an MLP across the sequence instead of attention (the Sudoku variant)")


def _swiglu_width(dim: int, expansion: float = 4) -> int:
    """The references' SwiGLU width: 2/3 of expansion x dim, rounded up to a multiple of 256."""
    return -(-round(expansion * dim * 2 / 3) // 256) * 256


class ReasoningBlock(nnx.Module):
    """Post-norm block: h <- norm(h + mix(h)); h <- norm(h + mlp(h)), with mix attention or a token MLP."""

    def __init__(self, cfg: RecursiveConfig, seq_len: int, mlp_t: bool, rngs: nnx.Rngs):
        d, dtype = cfg.d_model, jnp.dtype(cfg.compute_dtype)
        self.eps = cfg.norm_eps
        if mlp_t:
            width = _swiglu_width(seq_len)
            self.token_mlp = SwiGLU(
                seq_len,
                width,
                std=seq_len**-0.5,
                out_std=width**-0.5,
                dtype=dtype,
                rngs=rngs,
                axis="seq",
                x_axes=("act_batch", "act_embed", "act_seq"),
                recompute=True,
                kernel=cfg.mlp_kernel,
            )
        else:
            self.attn = Attention(
                d,
                cfg.n_heads,
                cfg.n_heads,
                std=d**-0.5,
                out_std=d**-0.5,
                dtype=dtype,
                implementation=cfg.attention,
                rngs=rngs,
                causal=False,
            )
        self.mlp = SwiGLU(
            d,
            cfg.d_ff,
            std=d**-0.5,
            out_std=cfg.d_ff**-0.5,
            dtype=dtype,
            rngs=rngs,
            recompute=True,
            kernel=cfg.mlp_kernel,
        )

    def __call__(self, h: jax.Array, rope) -> jax.Array:
        h = constrain(h, ACT)
        if hasattr(self, "token_mlp"):  # normalised over the sequence, as in the reference
            t = h.swapaxes(1, 2)
            h = rms_norm_keeping_input(t + self.token_mlp(t), self.eps).astype(h.dtype).swapaxes(1, 2)
        else:
            h = rms_norm_keeping_input(h + self.attn(h, rope), self.eps).astype(h.dtype)
        return constrain(rms_norm_keeping_input(h + self.mlp(h), self.eps).astype(h.dtype), ACT)


class ReasoningModule(nnx.Module):
    """A stack of blocks that first adds its input injection: f(h, injection)."""

    def __init__(self, cfg: RecursiveConfig, n_layers: int, seq_len: int, mlp_t: bool, rngs: nnx.Rngs):
        self.layers = stacked(n_layers, lambda r: ReasoningBlock(cfg, seq_len, mlp_t, r), rngs)
        self.remat, self.unroll, self.precision = cfg.remat, cfg.scan_unroll, cfg.matmul_precision

    def __call__(self, h: jax.Array, injection: jax.Array, rope) -> jax.Array:
        layers = scan_layers(
            self.layers, h + injection, rope, remat=self.remat, unroll=self.unroll, precision=self.precision
        )
        return layers[0]


class RecursiveReasoner(nnx.Module):
    """What HRM and TRM share: embeddings, heads, initial states. Subclasses define `recurse`."""

    def __init__(self, cfg: RecursiveConfig, rngs: nnx.Rngs):
        d = cfg.d_model
        self.cfg = cfg
        self.length = cfg.max_seq_len + cfg.puzzle_emb_len
        self.embed = param(rngs, (cfg.vocab_size, d), ("vocab", "embed"), d**-0.5)
        self.puzzle_emb = nnx.Param(
            jnp.zeros((cfg.num_puzzle_ids, d), jnp.float32), out_sharding=(None, "embed"), eager_sharding=False
        )
        self.head = param(rngs, (d, cfg.vocab_size), ("embed", "vocab"), d**-0.5)
        self.q_head = nnx.Param(jnp.zeros((d, 2), jnp.float32), out_sharding=("embed", None), eager_sharding=False)
        self.q_bias = nnx.Param(jnp.full((2,), -5.0, jnp.float32), out_sharding=(None,), eager_sharding=False)

    def initial_carry(self, batch: int) -> tuple[jax.Array, jax.Array]:
        """(z_H, z_L): the same fixed truncated-normal vector at every position of every puzzle."""
        h, low = (
            jax.random.truncated_normal(jax.random.key(INIT_KEY), -2.0, 2.0, (2, self.cfg.d_model)) / 0.8796
        )  # std 1 after truncation
        shape, dtype = (batch, self.length, self.cfg.d_model), jnp.dtype(self.cfg.compute_dtype)
        return tuple(constrain(jnp.broadcast_to(z, shape).astype(dtype), ACT) for z in (h, low))

    def inputs(self, tokens: jax.Array, puzzle_ids: jax.Array) -> jax.Array:
        cfg, d = self.cfg, self.cfg.d_model
        x = embed_tokens(constrain(self.embed[...], TABLE), tokens)
        puzzle = jnp.take(self.puzzle_emb[...], puzzle_ids, axis=0)[:, None, :]
        front = jnp.concatenate([puzzle, jnp.zeros((len(tokens), self.cfg.puzzle_emb_len - 1, d), x.dtype)], axis=1)
        return constrain((math.sqrt(d) * jnp.concatenate([front, x], axis=1)).astype(jnp.dtype(cfg.compute_dtype)), ACT)

    def __call__(self, carry, tokens: jax.Array, puzzle_ids: jax.Array):
        """One segment: (carry, logits (batch, seq, vocab), q (batch, 2) = halt, continue logits)."""
        x = self.inputs(tokens, puzzle_ids)
        rope = (
            None
            if self.cfg.mlp_t
            else rope_tables(self.length, self.cfg.d_model // self.cfg.n_heads, self.cfg.rope_theta)
        )
        z_h, z_l = self.recurse(*carry, x, rope)
        dtype = z_h.dtype
        logits = output_head(z_h[:, self.cfg.puzzle_emb_len :], constrain(self.head[...], HEAD), dtype)
        q = z_h[:, 0].astype(jnp.float32) @ self.q_head[...] + self.q_bias[...][None]
        return jax.lax.stop_gradient((z_h, z_l)), logits, q


class HRM(RecursiveReasoner):
    def __init__(self, cfg: HrmConfig, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs)
        self.high = ReasoningModule(cfg, cfg.H_layers, self.length, False, rngs)
        self.low = ReasoningModule(cfg, cfg.L_layers, self.length, False, rngs)

    def recurse(self, z_h, z_l, x, rope):
        r = self.cfg
        for step in range(r.H_cycles * r.L_cycles - 1):  # without gradients
            z_l = self.low(z_l, z_h + x, rope)
            if (step + 1) % r.L_cycles == 0:
                z_h = self.high(z_h, z_l, rope)
        z_h, z_l = jax.lax.stop_gradient((z_h, z_l))
        z_l = self.low(z_l, z_h + x, rope)  # the one-step gradient
        return self.high(z_h, z_l, rope), z_l


class TRM(RecursiveReasoner):
    def __init__(self, cfg: TrmConfig, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs)
        self.net = ReasoningModule(cfg, cfg.L_layers, self.length, cfg.mlp_t, rngs)

    def recurse(self, y, z, x, rope):
        def cycle(y, z):
            for _ in range(self.cfg.L_cycles):
                z = self.net(z, y + x, rope)
            return self.net(y, z, rope), z

        for _ in range(self.cfg.H_cycles - 1):  # without gradients
            y, z = jax.lax.stop_gradient(cycle(y, z))
        return cycle(y, z)


def flops_per_token(cfg: RecursiveConfig, n_params: int, seq_len: int) -> float:
    """Training FLOPs per puzzle cell of one supervision segment. A block pass costs 2 FLOPs per
    matmul weight (the token MLP of mlp_t counts as 3·d·width weights per position) plus attention's
    4·length·d; the backward of the passes with gradients costs twice their forward; HRM's target
    Q-value repeats the segment's forward. All `length` positions are counted, per cell."""
    r, d, length = cfg, cfg.d_model, seq_len + cfg.puzzle_emb_len
    mix = 3 * d * _swiglu_width(length) if cfg.mlp_t else 4 * d * d + 2 * length * d
    block = 2 * (mix + 3 * d * cfg.d_ff)
    if isinstance(cfg, HrmConfig):
        forward, with_grad = r.H_cycles * (r.L_cycles * r.L_layers + r.H_layers), r.L_layers + r.H_layers
    else:
        forward, with_grad = r.H_cycles * (r.L_cycles + 1) * r.L_layers, (r.L_cycles + 1) * r.L_layers
    passes = forward * (1 if r.no_ACT_continue else 2) + 2 * with_grad
    return block * passes * length / seq_len + 6 * d * cfg.vocab_size


DEBUG = {"d_model": 128, "n_heads": 4, "d_ff": 384}  # the tiny job's widths, for --use-small-model

HRM_FAMILY = Family(HrmConfig, HRM, flops_per_token, "puzzles", DEBUG, recurrent=True, stacks=("H_layers", "L_layers"))
TRM_FAMILY = Family(TrmConfig, TRM, flops_per_token, "puzzles", DEBUG, recurrent=True, stacks=("L_layers",))
