"""Sampling text from a trained language model: after training, and from a run directory."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from podtrain import runtime
from podtrain.config import MeshConfig, resolve_auto, run_config
from podtrain.data.text import run_tokenizer
from podtrain.errors import ConfigError
from podtrain.models import task_of
from podtrain.runtime.mesh import sharded_jit
from podtrain.train.checkpoint import Checkpointer, run_checkpoints
from podtrain.train.state import ModelFns, model_fns

PREFILL_MIN = 64  # the shortest prefill: prompts are padded to a power of two, so that few lengths compile


def _pick(logits: jax.Array, temperature: float, key: jax.Array) -> jax.Array:
    return jnp.argmax(logits) if temperature == 0 else jax.random.categorical(key, logits / temperature)


def _prompt_tokens(tokenizer, prompt: str) -> list[int]:
    """The prompt's tokens; an empty prompt starts from EOS (or a newline for bytes)."""
    return list(tokenizer.encode(prompt)) or (
        [tokenizer.eos_id] if tokenizer.eos_id is not None else tokenizer.encode("\n")
    )


def sample(
    fns: ModelFns,
    params,
    tokenizer,
    prompt: str,
    max_new_tokens: int,
    temperature: float,
    window: int,
    seed: int = 0,
    cache: bool = True,
) -> str:
    """Continue `prompt` for `max_new_tokens` (temperature 0: greedy), decoded with `tokenizer`."""
    tokens = _prompt_tokens(tokenizer, prompt)
    generate = cached_tokens if cache else window_tokens
    return tokenizer.decode(generate(fns, params, tokens, max_new_tokens, temperature, window, seed))


def window_tokens(
    fns: ModelFns, params, tokens: list[int], n: int, temperature: float, window: int, seed: int
) -> list[int]:
    """n tokens after `tokens`, each from a full forward pass over the last `window` tokens, padded
    on the right so that one compiled pass serves every position (causal attention ignores the padding)."""

    def next_token(params, buf, pos, key):
        return _pick(fns.apply(params, buf[None])[0, pos - 1], temperature, key)

    next_token = sharded_jit(next_token, fns.mesh)
    tokens, key = list(tokens), jax.random.key(seed)
    for _ in range(n):
        context = tokens[-window:]
        buf = np.zeros(window, np.int32)
        buf[: len(context)] = context
        key, sub = jax.random.split(key)
        tokens.append(int(next_token(params, buf, len(context), sub)))
    return tokens[-n:] if n else []


def cached_tokens(
    fns: ModelFns, params, tokens: list[int], n: int, temperature: float, window: int, seed: int
) -> list[int]:
    """n tokens after `tokens` with a key/value cache of `window` positions: one pass over the
    prompt (prefill, padded to a power of two), then one position per token, each program
    compiled once per shape. When the cache is full, the last half window is prefilled again."""

    def prefill(params, buf, length, key):
        model = fns.module(params)
        logits, kv = model.decode(buf[None], model.init_cache(1, window), jnp.int32(0))
        return _pick(logits[0, length - 1], temperature, key), kv

    def step(params, token, kv, pos, key):
        logits, kv = fns.module(params).decode(token.reshape(1, 1), kv, pos)
        return _pick(logits[0, 0], temperature, key), kv

    prefill, step = sharded_jit(prefill, fns.mesh), sharded_jit(step, fns.mesh, donate_argnums=2)
    tokens, key, pos = list(tokens), jax.random.key(seed), window
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
    return tokens[-n:] if n else []


def run_model(run_dir: str):
    """(config, model functions, weights) of a run's latest checkpoint (its EMA where it kept one),
    on this machine's devices with the params replicated."""
    cfg = run_config(run_dir)
    if task_of(cfg.model) != "text":
        raise ConfigError(
            f"{run_dir} trained model.name={cfg.model.name}, which solves puzzles; generate and convert take a language model (llama, mhc)."
        )
    cfg = dataclasses.replace(cfg, mesh=MeshConfig(data=-1, fsdp=1, tensor=1), device_type="auto")
    rt = runtime.start(cfg, announce=False)
    cfg = resolve_auto(cfg, rt.platform)
    fns = model_fns(cfg, rt.mesh)
    checkpointer = Checkpointer(run_checkpoints(run_dir, cfg))
    try:
        return cfg, fns, checkpointer.restore_weights(fns.abstract_params)
    finally:
        checkpointer.close()


def generate_from_run(
    run_dir: str, prompt: str, max_new_tokens: int, temperature: float, seed: int = 0, cache: bool = True
) -> str:
    """Sample from the latest checkpoint of a run with the run's tokenizer, over a window of the
    model's positions (model.max_seq_len) with the cache or without it."""
    cfg, fns, params = run_model(run_dir)
    return sample(
        fns, params, run_tokenizer(run_dir), prompt, max_new_tokens, temperature, cfg.model.max_seq_len, seed, cache
    )
