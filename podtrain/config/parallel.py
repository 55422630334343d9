"""The parallelism sections of the config: the mesh's size along each axis (`mesh`, made from
`axes.MESH_AXES`, so an axis added there is a key, a docs row and a plan column at once), how a
layer stack runs over its stages (`pipeline`) and how attention runs over a split sequence
(`context`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from podtrain.axes import MESH_AXES
from podtrain.config.keys import key

_SIZES = "-1 or >= 1"
MeshConfig = dataclasses.make_dataclass(
    "MeshConfig",
    [(a.name, int, key(a.default, a.splits, _SIZES)) for a in MESH_AXES]
    + [(f"dcn_{a.name}", int, key(1, a.across_slices, _SIZES)) for a in MESH_AXES if a.across_slices],
)
MeshConfig.__module__ = __name__
MeshConfig.__doc__ = "Devices along each mesh axis (`mesh.NAME`), then slices along those that may span several."


@dataclass
class PipelineConfig:
    """How a layer stack runs over `mesh.stage` x `mesh.dcn_stage` stages."""

    microbatches: int = key(
        0,
        "microbatches the batch (each grad_accum microbatch) flows through the stages in; 0: as many as stages",
        ">= 0",
    )
    schedule: Literal["gpipe", "circular"] = key(
        "gpipe",
        "gpipe: each stage holds consecutive layers, every microbatch passes each stage once; circular: the layers "
        "cut into stages x repeats pieces, stage s holding pieces s, s + stages, ..., so every microbatch goes round "
        "the stages `repeats` times: a bubble of (stages - 1) / (repeats x microbatches + stages - 1), for one "
        "regrouping of the stacked weights along `stage` per step",
    )
    repeats: int = key(1, "laps of the circular schedule round the stages (1 with gpipe)", ">= 1")


@dataclass
class ContextConfig:
    """How attention runs over a sequence `mesh.context` splits."""

    strategy: str = key(
        "all_gather",
        "all_gather: every shard's keys and values gathered per layer; ring: passed round a ring of the context "
        "shards, one shard's at a time (less memory, more steps)",
    )
