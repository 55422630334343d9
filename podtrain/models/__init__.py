"""Model registry: `model.name` -> (module class, FLOPs-per-token formula)."""

from __future__ import annotations

from flax import nnx

from podtrain.config import ModelConfig
from podtrain.errors import ConfigError
from podtrain.models import llama, mhc, recursive

MODELS = {
    "llama": (llama.Llama, llama.flops_per_token),
    "mhc": (mhc.Mhc, mhc.flops_per_token),
    "hrm": (recursive.HRM, recursive.flops_per_token),
    "trm": (recursive.TRM, recursive.flops_per_token),
}


def _lookup(name: str):
    if name not in MODELS:
        raise ConfigError(f"model.name={name!r} is not a known model; choose one of: {', '.join(MODELS)}.")
    return MODELS[name]


def build_model(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
    return _lookup(cfg.name)[0](cfg, rngs=rngs)


def flops_per_token(cfg: ModelConfig, n_params: int, seq_len: int) -> float:
    return _lookup(cfg.name)[1](cfg, n_params, seq_len)


def is_reasoner(name: str) -> bool:
    """Whether the model solves puzzles in supervision segments (HRM, TRM) rather than modelling text."""
    return issubclass(_lookup(name)[0], recursive.RecursiveReasoner)
