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


def sample(fns: ModelFns, params, tokenizer, prompt: str, max_new_tokens: int, temperature: float, window: int, seed: int = 0) -> str:
    """Continue `prompt` token by token. The context is a fixed-size window padded on the right,
    so one compiled forward pass serves every position (causal attention ignores the padding)."""

    def next_token(params, buf, pos, key):
        logits = fns.apply(params, buf[None])[0, pos - 1]
        if temperature == 0:
            return jnp.argmax(logits)
        return jax.random.categorical(key, logits / temperature)

    next_token = sharded_jit(next_token, fns.mesh)

    prompt_tokens = tokenizer.encode(prompt)
    tokens = list(prompt_tokens) or ([tokenizer.eos_id] if tokenizer.eos_id is not None else tokenizer.encode("\n"))
    key = jax.random.key(seed)
    for _ in range(max_new_tokens):
        context = tokens[-window:]
        buf = np.zeros(window, np.int32)
        buf[: len(context)] = context
        key, sub = jax.random.split(key)
        tokens.append(int(next_token(params, buf, len(context), sub)))
    return tokenizer.decode(tokens[len(prompt_tokens) :])


def generate_from_run(run_dir: str, prompt: str, max_new_tokens: int, temperature: float, seed: int = 0) -> str:
    """Sample from the latest checkpoint of a run (its EMA weights where it kept them) with the
    run's tokenizer, on this machine's devices with the params replicated."""
    cfg = run_config(run_dir)
    if task_of(cfg.model) != "text":
        raise ConfigError(f"{run_dir} trained model.name={cfg.model.name}, which solves puzzles; generate samples text from a language model (llama, mhc).")
    cfg = dataclasses.replace(cfg, mesh=MeshConfig(data=-1, fsdp=1, tensor=1), device_type="auto")
    rt = runtime.start(cfg, announce=False)
    cfg = resolve_auto(cfg, rt.platform)
    fns = model_fns(cfg, rt.mesh)
    checkpointer = Checkpointer(run_checkpoints(run_dir, cfg))
    name = "ema" if cfg.train.ema else "params"
    params = checkpointer.restore({name: fns.abstract_params})[name]
    checkpointer.close()
    return sample(fns, params, run_tokenizer(run_dir), prompt, max_new_tokens, temperature, cfg.train.seq_len, seed)
