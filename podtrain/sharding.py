"""How arrays are laid out on the mesh `data x stage x fsdp x context x expert x tensor`: one table
from logical axis names to mesh axes, and the few functions that apply it.

Parameters and activations both name logical axes; `RULES` alone decides what each mesh axis
shards. Models pin their activations with `constrain`, which takes effect while a function
compiled by `sharded_jit` is traced on a mesh and does nothing elsewhere, so a model never sees
a mesh. Without those pins XLA's partitioner follows the weights, and an fsdp-sharded embedding
turns fsdp into model parallelism with activation-sized all-reduces. This module imports no
config and no runtime: models and tasks import it and nothing else of the mesh.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# Logical axis -> mesh axes. Changing a model's parallelism is a change here, not in the model.
RULES: dict[str, tuple[str, ...]] = {
    # Parameters: ZeRO-3 over fsdp (gathered layer by layer where used), Megatron over tensor.
    "embed": ("fsdp",),
    "mlp": ("tensor",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "vocab": ("tensor",),
    "head_dim": (),
    "latent": (),  # latent attention's low-rank widths (q_lora_rank, kv_lora_rank + the rotary key)
    "lora": (),  # the rank of a LoRA adapter (models/lora.py)
    "layers": ("stage",),  # a stack's layers, cut into consecutive pipeline stages
    "seq": (),  # the token-mixing weights of TRM's mlp_t
    "streams": (),  # mHC's residual streams and their mixing coefficients
    "exp": ("expert",),  # an MoE layer's experts
    # Activations: the batch over data x fsdp x expert, the sequence over context, features over
    # tensor only; fsdp never splits a feature, so it moves weights, not activations. No weight is
    # split over context, and only experts over expert: the others' gradients are reduced over
    # them as over data (outside the MoE layers the expert axis is data parallelism).
    "act_batch": ("data", "stage", "fsdp", "expert"),
    "act_seq": ("context",),
    "act_embed": (),
    "act_heads": ("tensor",),
    "act_kv_heads": ("tensor",),
    "act_head_dim": (),
    "act_mlp": ("tensor",),
    "act_vocab": ("tensor",),
    "act_streams": (),
}

_TRACING_MESH: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("podtrain_tracing_mesh", default=None)


class Parallelism(NamedTuple):
    """How the mesh's stage and context axes run, beyond their sizes: a layer stack over `stage` in
    `microbatches` (0: as many as stages), going round the stages `repeats` times (1: GPipe; more:
    circular; `models.pipeline`); attention over a sequence split along `context` by the `context`
    strategy, all_gather or ring (`models.attention.context`)."""

    microbatches: int = 0
    repeats: int = 1
    context: str = "all_gather"

    @classmethod
    def of(cls, cfg) -> Parallelism:
        """What a config's `pipeline` and `context` sections say."""
        return cls(cfg.pipeline.microbatches, cfg.pipeline.repeats, cfg.context.strategy)


def microbatches_over(stages: int, asked: int) -> int:
    """The microbatches a pipeline of `stages` stages runs for `pipeline.microbatches=asked` (0: as many as stages)."""
    return asked or stages


DEFAULT = Parallelism()  # GPipe of as many microbatches as stages; keys and values all-gathered
_PARALLELISM: contextvars.ContextVar[Parallelism] = contextvars.ContextVar("podtrain_parallelism", default=DEFAULT)
_TAKEN: contextvars.ContextVar[frozenset] = contextvars.ContextVar("podtrain_taken_axes", default=frozenset())


def _placement(names: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh):
    """(mesh axes per dimension, (dimension, name, size, axis) for each rule a dimension could not take)."""
    used: set[str] = set(_TAKEN.get())
    placed, dropped = [], []
    for i, (name, dim) in enumerate(zip(names, shape)):
        axes = []
        for axis in RULES.get(name, ()) if name else ():
            if axis in used:
                continue
            if dim % (math.prod(mesh.shape[a] for a in axes) * mesh.shape[axis]) == 0:
                axes.append(axis)
            else:
                dropped.append((i, name, dim, axis))
        used.update(axes)
        placed.append(tuple(axes))
    return placed, dropped


def logical_spec(names: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """Map logical axis names to mesh axes, keeping only mesh axes that divide the dimension.

    A dimension too small for its mesh axes (4 kv heads on tensor=8, a batch of 1) is replicated
    over them instead of failing, so one rules table serves every mesh (`replicated` lists where).
    """
    placed, _ = _placement(names, shape, mesh)
    return PartitionSpec(*(axes if len(axes) > 1 else axes[0] if axes else None for axes in placed))


def logical_sharding(names: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, logical_spec(names, shape, mesh))


def replicated(named_shapes: dict[str, tuple[tuple, tuple]], mesh: Mesh) -> list[str]:
    """Where the rules fell back to replication: 'NAME: NAME_AXIS of SIZE over AXIS=N' for each
    array (by name: (logical names, shape)) whose dimension a mesh axis does not divide."""
    found = []
    for array, (names, shape) in named_shapes.items():
        for _, name, dim, axis in _placement(names, shape, mesh)[1]:
            found.append(f"{array}: {name} of {dim} over {axis}={mesh.shape[axis]}")
    return found


# The TPU compiler's partitioning choices for fsdp. By default it overlaps a weight's all-gather
# (and a gradient's reduce-scatter) with its matmul in a windowed einsum: a loop over the shards
# that, where the sharded dimension is contracted, reads and writes the whole output once per
# shard. Gathering the layer's weights whole instead (still asynchronous, ahead of their use) and
# reducing each gradient in one all-reduce-scatter fusion moves 445 -> 257 GiB per chip in the 3B
# twin's step (docs/performance.md). MaxText's tuned flag sets turn the windowed einsums off too.
TPU_COMPILER_OPTIONS = {
    "xla_tpu_enable_windowed_einsum_for_all_gather": False,
    "xla_tpu_enable_windowed_einsum_for_reduce_scatter": False,
    "xla_tpu_use_minor_sharding_for_major_trivial_input": True,
    "xla_tpu_relayout_group_size_threshold_for_reduce_scatter": 1,
}


def sharded_jit(fn, mesh: Mesh, parallelism: Parallelism = DEFAULT, **jit_kwargs):
    """jax.jit(fn), traced with `mesh` active so that the activation constraints inside apply
    (and a layer stack over `stage` and attention over `context` run as `parallelism` says); on
    TPU compiled with `TPU_COMPILER_OPTIONS`."""

    @functools.wraps(fn)
    def on_mesh(*args, **kwargs):
        tokens = _TRACING_MESH.set(mesh), _PARALLELISM.set(parallelism)
        try:
            return fn(*args, **kwargs)
        finally:
            _TRACING_MESH.reset(tokens[0])
            _PARALLELISM.reset(tokens[1])

    if mesh.devices.flat[0].platform == "tpu":
        jit_kwargs.setdefault("compiler_options", TPU_COMPILER_OPTIONS)
    return jax.jit(on_mesh, **jit_kwargs)


def constrain(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """Pin an activation's sharding by its logical axis names (a no-op outside `sharded_jit`)."""
    mesh = _TRACING_MESH.get()
    return x if mesh is None else jax.lax.with_sharding_constraint(x, logical_sharding(names, x.shape, mesh))


def per_shard(fn, in_names: tuple, out_names: tuple[str | None, ...]):
    """fn run on each device's shard of arrays laid out by logical names (jax.shard_map), for
    kernels XLA cannot partition (Pallas) and collectives along a logical axis (`gather`,
    `pass_on`); fn itself outside `sharded_jit`. An entry of `in_names` may instead be a function
    giving that argument's partition specs (a kernel's own) from `placed(names, shape)`, the
    sharding of an array of that shape laid out by those logical names; the output is laid out
    like the first argument."""
    mesh = _TRACING_MESH.get()
    if mesh is None:
        return fn

    def run(*arrays):
        specs = tuple(
            names(functools.partial(logical_sharding, mesh=mesh))
            if callable(names)
            else logical_spec(names, x.shape, mesh)
            for names, x in zip(in_names, arrays)
        )
        out_spec = logical_spec(out_names, arrays[0].shape, mesh)
        return jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=out_spec, check_vma=False)(*arrays)

    return run


def stages() -> tuple[int, Parallelism]:
    """(pipeline stages, how they run) of the function being traced: the mesh's `stage` size and
    its `Parallelism`, microbatches resolved (as many as stages if none were asked for); (1, 1 and
    1) outside `sharded_jit`."""
    mesh = _TRACING_MESH.get()
    n = 1 if mesh is None else mesh.shape["stage"]
    if n == 1:
        return 1, Parallelism(1, 1)
    asked = _PARALLELISM.get()
    return n, asked._replace(microbatches=microbatches_over(n, asked.microbatches))


def context_strategy() -> str:
    """How attention runs over a sequence split along `context` in the function being traced."""
    return _PARALLELISM.get().context


@contextlib.contextmanager
def per_stage():
    """Inside: code vmapped over the pipeline's stages, which adds their `stage` dimension to
    every array itself; no constraint there may name `stage`."""
    token = _TAKEN.set(_TAKEN.get() | {"stage"})
    try:
        yield
    finally:
        _TAKEN.reset(token)


def _split_over(name: str) -> tuple[str, ...]:
    """The mesh axes of more than one device that the rules give logical axis `name`."""
    mesh = _TRACING_MESH.get()
    return () if mesh is None else tuple(a for a in RULES[name] if mesh.shape[a] > 1)


def shards_along(name: str) -> int:
    """Inside `per_shard`: how many shards logical axis `name` was split into."""
    over = _split_over(name)
    return math.prod(_TRACING_MESH.get().shape[a] for a in over) if over else 1


def gather(x: jax.Array, name: str, axis: int) -> jax.Array:
    """Inside `per_shard`: every device's shard of x along logical axis `name`, joined on `axis`
    in shard order (an all-gather over that name's mesh axes)."""
    over = _split_over(name)
    return jax.lax.all_gather(x, over, axis=axis, tiled=True) if over else x


def scatter_sum(x: jax.Array, name: str, axis: int) -> jax.Array:
    """Inside `per_shard`: the sum of x over the shards along logical axis `name`, of which this
    shard keeps its own part along `axis` (a reduce-scatter; `gather`'s transpose)."""
    over = _split_over(name)
    return jax.lax.psum_scatter(x, over, scatter_dimension=axis, tiled=True) if over else x


def sum_over(x: jax.Array, name: str) -> jax.Array:
    """Inside `per_shard`: the sum of x over the shards along logical axis `name` (an all-reduce)."""
    over = _split_over(name)
    return jax.lax.psum(x, over) if over else x


def exchange(x: jax.Array, name: str) -> jax.Array:
    """Inside `per_shard`: x (n, ...), whose slice i is for shard i along logical axis `name`, ->
    (n, ...), whose slice i came from shard i (an all-to-all over that name's mesh axes)."""
    over = _split_over(name)
    return jax.lax.all_to_all(x, over, 0, 0, tiled=True) if over else x


def ragged_exchange(rows, into, sent_from, sent, lands_at, received, name: str) -> jax.Array:
    """Inside `per_shard`: `into` with the row blocks other shards along logical axis `name` sent
    written in; this shard sends rows[sent_from[i]:][:sent[i]] to shard i // (len(sent) / n), to
    land at its row lands_at[i], and receives received[i] rows from that shard (the jax.lax
    ragged_all_to_all over that name's mesh axes, which XLA's CPU backend cannot run)."""
    over = _split_over(name)
    return jax.lax.ragged_all_to_all(rows, into, sent_from, sent, lands_at, received, axis_name=over)


def exchanges_ragged() -> bool:
    """Whether the mesh being traced on can run a ragged all-to-all: TPU and GPU, not XLA's CPU
    backend (jax #34755)."""
    mesh = _TRACING_MESH.get()
    return mesh is not None and mesh.devices.flat[0].platform != "cpu"


def shard_index(name: str) -> jax.Array | int:
    """Inside `per_shard`: this shard's place along logical axis `name` (0 where it is whole)."""
    over = _split_over(name)
    return jax.lax.axis_index(over) if over else 0


def pass_on(x, name: str):
    """Inside `per_shard`: x (a tree) from the shard before this one along logical axis `name`,
    the first shard getting the last's (one step of a ring over that name's mesh axes)."""
    over, n = _split_over(name), shards_along(name)
    return jax.tree.map(lambda a: jax.lax.ppermute(a, over, [(i, (i + 1) % n) for i in range(n)]), x)


def balanced_order(t: int, n: int) -> np.ndarray:
    """An order of t positions for n shards of a causal sequence that gives each shard equal work:
    cut into 2n chunks, shard i holds chunk i and chunk 2n-1-i (n=2: 0 1 2 3 -> 0 3 1 2)."""
    chunks = np.arange(t).reshape(2 * n, t // (2 * n))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * n - 1 - i]]) for i in range(n)])


def positions_of(shape: tuple[int, ...]) -> jax.Array:
    """(batch, seq): 0, 1, ... seq - 1 in every row."""
    return jnp.broadcast_to(jnp.arange(shape[1]), shape[:2])


def reordered(order: np.ndarray, *arrays) -> tuple:
    """Each (batch, seq, ...) array, or None, with its positions taken in `order`."""
    return tuple(None if a is None else a[:, order] for a in arrays)


def context_order(t: int) -> np.ndarray | None:
    """The order a sequence of t positions takes where the mesh splits it (`balanced_order` over
    its context shards), or None where it is whole (and outside `sharded_jit`)."""
    n = shards("act_seq", t)
    return None if n == 1 else balanced_order(t, n)


def shards(name: str, size: int) -> int:
    """Into how many pieces the rules split a dimension of `size` named `name` (1 outside `sharded_jit`)."""
    mesh = _TRACING_MESH.get()
    if mesh is None:
        return 1
    axes = logical_spec((name,), (size,), mesh)[0] or ()
    return math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))


def batch_sharding(mesh: Mesh, leading: int = 0) -> NamedSharding:
    """Rows of a batch over the batch's axes (RULES["act_batch"]); `leading` unsharded axes first (microbatches)."""
    return NamedSharding(mesh, PartitionSpec(*(None,) * leading, RULES["act_batch"]))


def data_parallel_size(mesh: Mesh) -> int:
    return math.prod(mesh.shape[a] for a in RULES["act_batch"])


def shardings_of(abstract):
    """The shardings of a tree of jax.ShapeDtypeStruct."""
    return jax.tree.map(lambda s: s.sharding, abstract)
