"""The batched sampler: prompts of different lengths continued together on the model's mesh, with
a key/value cache, inside one compiled loop (one dispatch per batch, not one per token); and the
log-probabilities of given tokens (`score`), for evaluation. Used by `generate`, the end-of-run
sample and `podtrain eval`'s tasks.

The params stay as they are sharded (fsdp, tensor, expert) and the rows of the batch go over the
batch's axes, as in training. Shapes are rounded up (rows to a power of two and a multiple of the
batch's shards, prompts to a power of two) so that few programs compile.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from podtrain.data.chat import stop_ids
from podtrain.errors import ConfigError
from podtrain.sharding import batch_sharding, data_parallel_size, sharded_jit

PREFILL_MIN = 16  # the narrowest prompt buffer


@dataclass(frozen=True)
class Sampling:
    """How each next token is drawn: temperature 0 is greedy; otherwise from softmax(logits /
    temperature) restricted to the `top_k` most likely tokens (0: all) and to the smallest set whose
    probability reaches `top_p` (1: all)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ConfigError(
                f"Sampling temperature={self.temperature}, top_k={self.top_k}, top_p={self.top_p}: give a "
                "temperature >= 0 (0: greedy), a top_k >= 0 (0: every token) and a top_p in (0, 1]."
            )


@dataclass
class Completion:
    tokens: list[int]  # the new tokens, a stop token that ended them left out
    logprobs: list[float]  # of each of `tokens`, under softmax(logits / temperature) (greedy: the logits')
    stopped: bool  # ended at a stop token, not at max_new_tokens or the model's last position


@dataclass
class Scored:
    logprobs: np.ndarray  # (len - 1,): entry t - 1 is log p(token t | the tokens before it)
    greedy: np.ndarray  # (len - 1,) bool: whether token t is the most likely one there


class Same:
    """A key of the compiled programs' cache that is equal only to itself: a model's graph (its
    config is a plain dataclass, not hashable), held by the cache so that its id stays its own."""

    def __init__(self, value):
        self.value = value

    def __hash__(self):
        return id(self.value)

    def __eq__(self, other):
        return isinstance(other, Same) and other.value is self.value


def rounded(n: int, least: int = 1) -> int:
    """The power of two >= n and >= least."""
    return max(least, 1 << max(n - 1, 0).bit_length())


def padded(mesh, sequences: Sequence[Sequence[int]], width: int) -> np.ndarray:
    """The sequences as rows of `width` tokens, padded on the right with 0, and with empty rows up to
    a power of two and a multiple of the mesh's batch shards."""
    shards = data_parallel_size(mesh)
    tokens = np.zeros((-(-rounded(len(sequences)) // shards) * shards, width), np.int32)
    for i, s in enumerate(sequences):
        tokens[i, : len(s)] = s
    return tokens


def generate(
    fns,
    params,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    *,
    stop: Sequence[int] = (),
    seeds: Sequence[int] | None = None,
    vocab: int | None = None,
    max_len: int,
) -> list[Completion]:
    """Up to `max_new_tokens` after each prompt (token ids, not empty), each row ending at its first
    `stop` token or at the model's last position (`max_len`); drawn among the first `vocab` tokens
    (a model's vocabulary may be padded past its tokenizer's) with row i's draws from `seeds[i]`
    (default i), so a row's sample does not depend on the others in the batch. A prompt of
    `max_len` tokens or more keeps its latest max_len - 1."""
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={max_new_tokens}: give at least 1.")
    prompts = [list(p)[-(max_len - 1) :] for p in prompts]
    if not all(prompts):
        raise ValueError("every prompt needs a token (an empty text starts from the tokenizer's EOS)")
    rows, tokens = len(prompts), padded(fns.mesh, prompts, rounded(max(map(len, prompts)), PREFILL_MIN))
    lengths = np.ones(len(tokens), np.int32)  # padding rows: one token
    lengths[:rows] = [len(p) for p in prompts]
    seeds = np.resize(np.asarray(range(rows) if seeds is None else seeds, np.uint32), len(tokens))
    new_tokens = min(max_new_tokens, max_len - min(map(len, prompts)))
    program = _decoder(Same(fns.graphdef), fns.mesh, new_tokens, max_len, sampling, tuple(stop), vocab)
    placed = jax.device_put((tokens, lengths, seeds), batch_sharding(fns.mesh))
    new, logprobs, counts, stopped = jax.device_get(program(params, *placed))
    return [
        Completion(
            new[i, : counts[i] - stopped[i]].tolist(), logprobs[i, : counts[i] - stopped[i]].tolist(), bool(stopped[i])
        )
        for i in range(rows)
    ]


def score(fns, params, sequences: Sequence[Sequence[int]], *, max_len: int) -> list[Scored]:
    """Each sequence's log-probabilities of its own tokens after the first, in one forward pass per
    batch (the sequences of one call are one batch). The last token is only a target, so a sequence
    may be one token longer than the model's `max_len` positions."""
    if too_long := [len(s) for s in sequences if len(s) > max_len + 1]:
        raise ValueError(f"sequences of {max(too_long)} tokens: the model has {max_len} positions")
    tokens = padded(fns.mesh, sequences, rounded(max(len(s) - 1 for s in sequences), PREFILL_MIN) + 1)
    logprobs, greedy = jax.device_get(
        _scorer(Same(fns.graphdef), fns.mesh)(params, jax.device_put(tokens, batch_sharding(fns.mesh)))
    )
    return [Scored(logprobs[i, : len(s) - 1], greedy[i, : len(s) - 1]) for i, s in enumerate(sequences)]


def _draw(logits: jax.Array, keys: jax.Array, sampling: Sampling) -> tuple[jax.Array, jax.Array]:
    """(batch, vocab) float32 logits -> each row's token and its log-probability."""
    if sampling.temperature == 0:
        token = jnp.argmax(logits, axis=-1)
        return token, jnp.take_along_axis(jax.nn.log_softmax(logits), token[:, None], axis=-1)[:, 0]
    scaled = logits / sampling.temperature
    allowed = scaled
    if sampling.top_k:
        kth = jax.lax.top_k(scaled, min(sampling.top_k, scaled.shape[-1]))[0][:, -1:]
        allowed = jnp.where(scaled < kth, -jnp.inf, allowed)
    if sampling.top_p < 1:
        ordered = jnp.sort(allowed, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # the mass of the likelier tokens
        least = jnp.min(jnp.where(before < sampling.top_p, ordered, jnp.inf), axis=-1, keepdims=True)
        allowed = jnp.where(allowed < least, -jnp.inf, allowed)
    token = jax.vmap(jax.random.categorical)(keys, allowed)
    return token, jnp.take_along_axis(jax.nn.log_softmax(scaled), token[:, None], axis=-1)[:, 0]


@functools.lru_cache(maxsize=32)
def _decoder(
    graph: Same, mesh, new_tokens: int, max_len: int, sampling: Sampling, stop: tuple[int, ...], vocab: int | None
):
    """The compiled generation: prefill every prompt at once (each row's own length cached), then
    a while loop of one token per row until every row has stopped, reached position `max_len` or
    made `new_tokens`."""

    def run(params, tokens, lengths, seeds):
        model = nnx.merge(graph.value, params)
        batch, width = tokens.shape
        keys = jax.vmap(jax.random.key)(seeds)

        def draw(logits, i):
            return _draw(
                logits[:, :vocab].astype(jnp.float32), jax.vmap(jax.random.fold_in, (0, None))(keys, i), sampling
            )

        cache = model.init_cache(batch, min(width + new_tokens, max_len))
        logits, cache = model.decode(tokens, cache, jnp.zeros(batch, jnp.int32), lengths)
        token, logprob = draw(jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0], 0)
        empty = jnp.zeros((batch, new_tokens))
        no = empty[:, 0] > 0
        state = (0, token, logprob, cache, empty.astype(jnp.int32), empty, jnp.zeros(batch, jnp.int32), no, no)

        def more(state):
            i, *_, ended = state
            return (i < new_tokens) & ~jnp.all(ended)

        def step(state):
            i, token, logprob, cache, new, logprobs, counts, stopped, ended = state
            new, logprobs = new.at[:, i].set(token), logprobs.at[:, i].set(logprob)
            counts = jnp.where(ended, counts, i + 1)
            stopped = stopped | (~ended & jnp.isin(token, jnp.asarray(stop, jnp.int32)))
            ended = stopped | (lengths + i + 1 >= max_len)
            logits, cache = model.decode(token[:, None].astype(jnp.int32), cache, lengths + i)
            return (i + 1, *draw(logits[:, 0], i + 1), cache, new, logprobs, counts, stopped, ended)

        _, _, _, _, new, logprobs, counts, stopped, _ = jax.lax.while_loop(more, step, state)
        return new, logprobs, counts, stopped

    return sharded_jit(run, mesh, out_shardings=everywhere(mesh))


def everywhere(mesh):
    """Outputs replicated: every process of a multi-host mesh reads the whole batch."""
    return NamedSharding(mesh, PartitionSpec())


@functools.lru_cache(maxsize=8)
def _scorer(graph: Same, mesh):
    def run(params, tokens):
        logits = nnx.merge(graph.value, params)(tokens[:, :-1]).astype(jnp.float32)
        logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1)[..., 0]
        return logprobs, jnp.argmax(logits, axis=-1) == tokens[:, 1:]

    return sharded_jit(run, mesh, out_shardings=everywhere(mesh))


def complete(
    fns,
    params,
    tokenizer,
    prompts: Sequence[str],
    max_new_tokens: int,
    sampling=Sampling(),
    *,
    seeds=None,
    max_len: int,
) -> list[str]:
    """Each text prompt's continuation, decoded, until the tokenizer's stop tokens
    (`data.chat.stop_ids`: EOS, the chat template's end of turn)."""
    start = [tokenizer.eos_id] if tokenizer.eos_id is not None else tokenizer.encode("\n")
    encoded = [list(tokenizer.encode(p)) or start for p in prompts]
    done = generate(
        fns,
        params,
        encoded,
        max_new_tokens,
        sampling,
        stop=stop_ids(tokenizer),
        seeds=seeds,
        vocab=tokenizer.vocab_size,
        max_len=max_len,
    )
    return [tokenizer.decode(c.tokens) for c in done]
