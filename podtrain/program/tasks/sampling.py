"""Sampling text from a language model given as its functions and params (train.state.ModelFns),
after training and from a run directory."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from podtrain.data.chat import stop_ids
from podtrain.sharding import sharded_jit

PREFILL_MIN = 64  # the shortest prefill: prompts are padded to a power of two, so that few lengths compile


def _pick(logits: jax.Array, temperature: float, key: jax.Array, vocab: int | None) -> jax.Array:
    """The next token among the tokenizer's `vocab` (a model's vocabulary may be padded past it)."""
    logits = logits[:vocab]
    return jnp.argmax(logits) if temperature == 0 else jax.random.categorical(key, logits / temperature)


def _prompt_tokens(tokenizer, prompt: str) -> list[int]:
    """The prompt's tokens; an empty prompt starts from EOS (or a newline for bytes)."""
    return list(tokenizer.encode(prompt)) or (
        [tokenizer.eos_id] if tokenizer.eos_id is not None else tokenizer.encode("\n")
    )


def sample(
    fns,
    params,
    tokenizer,
    prompt: str,
    max_new_tokens: int,
    temperature: float,
    window: int,
    seed: int = 0,
    cache: bool = True,
) -> str:
    """Continue `prompt` for up to `max_new_tokens` (temperature 0: greedy), decoded with `tokenizer`,
    until one of its stop tokens (`data.chat.stop_ids`: EOS, the chat template's end of turn), left out."""
    tokens, stop = _prompt_tokens(tokenizer, prompt), stop_ids(tokenizer)
    generate = cached_tokens if cache else window_tokens
    new = generate(fns, params, tokens, max_new_tokens, temperature, window, seed, tokenizer.vocab_size, stop)
    return tokenizer.decode(new[:-1] if new and new[-1] in stop else new)


def window_tokens(
    fns, params, tokens: list[int], n: int, temperature: float, window: int, seed: int, vocab=None, stop=()
) -> list[int]:
    """Up to n tokens after `tokens`, the last a `stop` token where one came, each from a full forward pass
    over the last `window` tokens, padded on the right so that one compiled pass serves every position
    (causal attention ignores the padding)."""

    def next_token(params, buf, pos, key):
        return _pick(fns.apply(params, buf[None])[0, pos - 1], temperature, key, vocab)

    next_token = sharded_jit(next_token, fns.mesh)
    tokens, key, start = list(tokens), jax.random.key(seed), len(tokens)
    for _ in range(n):
        context = tokens[-window:]
        buf = np.zeros(window, np.int32)
        buf[: len(context)] = context
        key, sub = jax.random.split(key)
        tokens.append(int(next_token(params, buf, len(context), sub)))
        if tokens[-1] in stop:
            break
    return tokens[start:]


def cached_tokens(
    fns, params, tokens: list[int], n: int, temperature: float, window: int, seed: int, vocab=None, stop=()
) -> list[int]:
    """Up to n tokens after `tokens` (the last a `stop` token where one came) with a key/value cache
    of `window` positions: one pass over the prompt (prefill, padded to a power of two), then one
    position per token, each program compiled once per shape. When the cache is full, the last half
    window is prefilled again."""

    def prefill(params, buf, length, key):
        model = fns.module(params)
        logits, kv = model.decode(buf[None], model.init_cache(1, window), jnp.int32(0), length)
        return _pick(logits[0, length - 1], temperature, key, vocab), kv

    def step(params, token, kv, pos, key):
        logits, kv = fns.module(params).decode(token.reshape(1, 1), kv, pos)
        return _pick(logits[0, 0], temperature, key, vocab), kv

    prefill, step = sharded_jit(prefill, fns.mesh), sharded_jit(step, fns.mesh, donate_argnums=2)
    tokens, key, pos, start = list(tokens), jax.random.key(seed), window, len(tokens)
    for _ in range(n):
        key, sub = jax.random.split(key)
        if pos == window:  # start, or a full cache: prefill the latest tokens
            context = tokens[-(window // 2 if len(tokens) >= window else window) :]
            buf = np.zeros(min(window, max(PREFILL_MIN, 1 << (len(context) - 1).bit_length())), np.int32)
            buf[: len(context)] = context
            token, kv = prefill(params, buf, len(context), sub)
            pos = len(context)
        else:
            token, kv = step(params, token, kv, jnp.int32(pos), sub)
            pos += 1
        tokens.append(int(token))
        if tokens[-1] in stop:
            break
    return tokens[start:]
