"""The model families by `model.name`, each registered beside its model as a `Family` record."""

from __future__ import annotations

from flax import nnx

from podtrain.config.schema import ModelConfig
from podtrain.models import llama, mhc, moe, recursive
from podtrain.models.family import Family

MODELS: dict[str, Family] = {
    f.name: f for f in (llama.FAMILY, mhc.FAMILY, moe.FAMILY, recursive.HRM_FAMILY, recursive.TRM_FAMILY)
}


def family(cfg: ModelConfig) -> Family:
    return MODELS[cfg.name]


def build_model(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
    return MODELS[cfg.name].module(cfg, rngs=rngs)
