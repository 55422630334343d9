"""A model family's record: everything podtrain needs to know of it, kept beside its model
(torchtitan's ModelSpec, levanter's registered configs)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from podtrain.config.schema import ModelConfig


@dataclass(frozen=True)
class Family:
    config: type[ModelConfig]  # its keys under `model.`, whose default `name` names the family
    module: type  # the Flax NNX module built from that config
    # (config, n_params, positions) -> training FLOPs; a language family's takes per_weight=4 for a frozen base
    flops_per_token: Callable[..., float]
    task: str  # what it trains on: a task's name in podtrain.program.tasks.registry, whose class names its train keys
    debug: dict[str, int]  # the tiny debug flavor: model keys that make any recipe small (--use-small-model)
    # (model config, params, the step's metrics) -> (params, metrics): what the family updates after
    # each optimizer step other than by gradients (an MoE's router bias), taking the metrics it reads
    after_step: Callable[[Any, Any, dict], tuple[Any, dict]] | None = None
    # its stacks run inside a recurrence, many passes a step (HRM, TRM): no pipeline over mesh.stage,
    # which would fill and drain at every pass
    recurrent: bool = False
    stacks: tuple[str, ...] = ("n_layers",)  # the model keys that are a scanned stack's length

    @property
    def name(self) -> str:
        """`model.name`: its config's default."""
        return self.config.name
