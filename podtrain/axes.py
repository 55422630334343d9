"""The mesh's axes, one table: the config's mesh keys, their docs, the aliases the field uses, the
plans' columns and the mesh itself are all made from `MESH_AXES` (what each axis shards is
`podtrain.sharding`'s table)."""

from __future__ import annotations

from typing import NamedTuple


class Axis(NamedTuple):
    """A mesh axis: what its devices split (the words of its `mesh.NAME` key), what slices of it
    split across the data-centre network where it may span several (its `mesh.dcn_NAME` key),
    whether every model takes it as it is (`plain`: stage, context and expert each need a model
    made for them), the field's other names of it, and its size by default (-1: the rest)."""

    name: str
    splits: str
    across_slices: str = ""
    plain: bool = True
    aliases: tuple[str, ...] = ()
    default: int = 1


# The mesh, outermost first: the last varies fastest, tensor on the nearest devices. The config's
# mesh keys, the docs, the plans and the environment's axis names all come from this table.
MESH_AXES = (
    Axis(
        "data",
        "devices that hold replicas and split the batch (-1: the rest)",
        "slices (TPU slices; off a TPU, processes) that split the batch across the data-centre network, each with "
        "the axes above inside it; -1: the rest. All dcn_ sizes 1: one mesh over every device",
        default=-1,
    ),
    Axis(
        "stage",
        "devices that each hold a consecutive stage of the layers (pipeline parallelism, `pipeline.*`); outside the "
        "layer stack they split the batch, as data does",
        "slices that each hold consecutive pipeline stages, across the network",
        plain=False,
    ),
    Axis(
        "fsdp",
        "devices that split the params, gradients and optimizer state (ZeRO-3)",
        "slices that split the params, gradients and optimizer state across the network",
    ),
    Axis(
        "context",
        "devices that split each sequence (context parallelism, `context.*`); weights replicated",
        plain=False,
        aliases=("cp", "sequence"),
    ),
    Axis(
        "expert",
        "devices that split an MoE layer's experts (expert parallelism), the tokens exchanged between them; "
        "elsewhere they split the batch, as data does",
        plain=False,
        aliases=("ep",),
    ),
    Axis("tensor", "devices that split heads, MLP width and vocabulary (Megatron)", aliases=("model", "tp")),
)
AXES = tuple(a.name for a in MESH_AXES)
PLAIN_AXES = tuple(a.name for a in MESH_AXES if a.plain)  # the axes every model takes as it is
DCN_AXES = tuple(a.name for a in MESH_AXES if a.across_slices)  # the axes that may also span slices
MESH_AXIS_ALIASES = {alias: a.name for a in MESH_AXES for alias in a.aliases}  # accepted in configs and TPU_AXIS_NAMES
