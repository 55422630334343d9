"""Model registry: `model.name` -> the family's config, module, FLOPs-per-token formula and task."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from flax import nnx

from podtrain.config import ModelConfig
from podtrain.models import llama, mhc, recursive


@dataclass(frozen=True)
class Family:
    config: type[ModelConfig]  # the family's keys under `model.`, defined beside the module
    module: type[nnx.Module]
    flops_per_token: Callable[[ModelConfig, int, int], float]  # (cfg, n_params, seq_len) -> training FLOPs
    task: str  # what it trains on: text (next-token prediction) | puzzles (deep supervision with ACT)


MODELS = {
    "llama": Family(llama.LlamaConfig, llama.Llama, llama.flops_per_token, "text"),
    "mhc": Family(mhc.MhcConfig, mhc.Mhc, mhc.flops_per_token, "text"),
    "hrm": Family(recursive.HrmConfig, recursive.HRM, recursive.flops_per_token, "puzzles"),
    "trm": Family(recursive.TrmConfig, recursive.TRM, recursive.flops_per_token, "puzzles"),
}


def build_model(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
    return MODELS[cfg.name].module(cfg, rngs=rngs)


def flops_per_token(cfg: ModelConfig, n_params: int, seq_len: int) -> float:
    return MODELS[cfg.name].flops_per_token(cfg, n_params, seq_len)


def task_of(cfg: ModelConfig) -> str:
    return MODELS[cfg.name].task
