"""What a language-model family provides: the keys every language model has, and the methods the
language task (`podtrain.program.tasks.language`) and the sampler (`podtrain.program.sampler`)
call on its module. A family whose `Family.task` is "language" subclasses the config and
implements the protocol; tests/test_model.py checks every registered one.

Shapes: B batch, T positions, D the model's width, V the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import jax

from podtrain.config.keys import key
from podtrain.config.schema import ModelConfig


@dataclass
class LanguageModelConfig(ModelConfig):
    """The keys of every language model, beside ModelConfig's."""

    loss_chunk: int = key(
        0, "positions per chunk of the loss, so one chunk's float32 logits exist at a time; 0: all at once", ">= 0"
    )


@runtime_checkable
class LanguageModel(Protocol):
    """A decoder over tokens. `features` and `logits` split the forward pass where the loss can be
    chunked: `logits(head, x)` of `features(tokens)`'s head and x is the model's output, and of a
    slice of the positions of x the same slice of it. `decode` runs the model incrementally on a cache
    made by `init_cache`; prefill and one-token steps are both calls of it."""

    cfg: LanguageModelConfig

    def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None, positions=None) -> jax.Array:
        """tokens (B, T) int32 -> logits (B, T, V) float32; `logits` of `features`' head and x."""

    def features(
        self, tokens: jax.Array, segment_ids: jax.Array | None = None, positions: jax.Array | None = None
    ) -> tuple[Any, jax.Array, dict]:
        """(head, x, aux): whatever `logits` needs beside the positions' states (a tied head's
        embedding table; passed back unchanged), the last layer's output x (B, T, D), and the
        model's auxiliary terms, float32 scalars: "loss" is added to the training loss (an MoE's
        balancing losses), the others are logged as metrics ({} for most models). With segment_ids
        (B, T) int32, a token attends only to earlier tokens of its own segment (packed documents),
        and never through a (T, T) mask: the model is given O(T) of it. `positions` (B, T) int32
        are the tokens' positions for the model's position encoding (default 0..T-1; they restart
        at each document with data.reset_positions). Where the mesh splits the sequence (context
        parallelism), tokens given with positions are in `sharding.balanced_order`, the order in
        which every shard does the same causal work; without, the model puts them in it."""

    def logits(self, head: Any, x: jax.Array) -> jax.Array:
        """(B, t, D) states of any t positions -> (B, t, V) float32 logits."""

    def decode(self, tokens: jax.Array, cache: Any, start: jax.Array, valid=None) -> tuple[jax.Array, Any]:
        """tokens (B, n) at positions start..start+n-1 -> (logits (B, n, V) float32, the cache with
        the keys and values of the first `valid` of them added (default all; the rest is padding,
        never cached)); they attend to the cache's earlier positions. `start` and `valid` may be
        traced int32 scalars, so one compiled program serves every position, or (B,) arrays, one
        per sequence: a batch of prompts of different lengths decodes together."""

    def init_cache(self, batch: int, length: int) -> Any:
        """An empty cache for `batch` sequences of up to `length` positions (a pytree of arrays)."""
