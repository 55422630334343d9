"""The named mesh `data x fsdp x tensor` and the one table that maps logical axes onto it.

Parameters and activations both name logical axes; `RULES` alone decides what each mesh axis
shards. Models pin their activations with `constrain`, which takes effect while a function
compiled by `sharded_jit` is traced on a mesh and does nothing elsewhere, so a model never sees
a mesh. Without those pins XLA's partitioner follows the weights, and an fsdp-sharded embedding
turns fsdp into model parallelism with activation-sized all-reduces.
"""

from __future__ import annotations

import contextvars
import functools
import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from podtrain.config import MeshConfig
from podtrain.errors import MeshError

AXES = ("data", "fsdp", "tensor")

# Logical axis -> mesh axes. Changing a model's parallelism is a change here, not in the model.
RULES: dict[str, tuple[str, ...]] = {
    # Parameters: ZeRO-3 over fsdp (gathered layer by layer where used), Megatron over tensor.
    "embed": ("fsdp",),
    "mlp": ("tensor",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "vocab": ("tensor",),
    "head_dim": (),
    "layers": (),
    "seq": (),  # the token-mixing weights of TRM's mlp_t
    "streams": (),  # mHC's residual streams and their mixing coefficients
    # Activations: the batch over data x fsdp, features over tensor only; fsdp never splits a
    # feature, so it moves weights, not activations.
    "act_batch": ("data", "fsdp"),
    "act_seq": (),
    "act_embed": (),
    "act_heads": ("tensor",),
    "act_kv_heads": ("tensor",),
    "act_head_dim": (),
    "act_mlp": ("tensor",),
    "act_vocab": ("tensor",),
    "act_streams": (),
}

_TRACING_MESH: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("podtrain_tracing_mesh", default=None)


def factorizations(n: int) -> list[tuple[int, int, int]]:
    return [
        (d, f, n // (d * f)) for d in range(n, 0, -1) if n % d == 0 for f in range(n // d, 0, -1) if (n // d) % f == 0
    ]


def resolve_shape(mesh: MeshConfig, n_devices: int) -> tuple[int, int, int]:
    sizes = [mesh.data, mesh.fsdp, mesh.tensor]
    named = " ".join(f"{a}={s}" for a, s in zip(AXES, sizes))
    valid = ", ".join("x".join(map(str, s)) for s in factorizations(n_devices)[:10])
    hint = f"Valid data x fsdp x tensor shapes for {n_devices} devices include {valid}; -1 on one axis takes the rest."
    if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
        raise MeshError(f"Mesh {named} is invalid: sizes must be positive, with at most one -1. {hint}")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if n_devices % known:
            raise MeshError(f"Mesh {named}: {n_devices} devices cannot be split into a multiple of {known}. {hint}")
        sizes[sizes.index(-1)] = n_devices // known
    elif known != n_devices:
        raise MeshError(f"Mesh {named} needs {known} devices but {n_devices} are available. {hint}")
    return tuple(sizes)


def build_mesh(mesh: MeshConfig, devices: list[jax.Device]) -> Mesh:
    shape = resolve_shape(mesh, len(devices))
    return jax.make_mesh(shape, AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3, devices=devices)


def logical_spec(names: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """Map logical axis names to mesh axes, keeping only mesh axes that divide the dimension.

    A dimension too small for its mesh axes (4 kv heads on tensor=8, a batch of 1) is replicated
    over them instead of failing, so one rules table serves every mesh.
    """
    used: set[str] = set()
    spec = []
    for name, dim in zip(names, shape):
        axes = []
        for axis in RULES.get(name, ()) if name else ():
            if axis not in used and dim % (math.prod(mesh.shape[a] for a in axes) * mesh.shape[axis]) == 0:
                axes.append(axis)
        used.update(axes)
        spec.append(tuple(axes) if len(axes) > 1 else axes[0] if axes else None)
    return PartitionSpec(*spec)


def logical_sharding(names: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, logical_spec(names, shape, mesh))


def sharded_jit(fn, mesh: Mesh, **jit_kwargs):
    """jax.jit(fn), traced with `mesh` active so that the activation constraints inside apply."""

    @functools.wraps(fn)
    def on_mesh(*args, **kwargs):
        token = _TRACING_MESH.set(mesh)
        try:
            return fn(*args, **kwargs)
        finally:
            _TRACING_MESH.reset(token)

    return jax.jit(on_mesh, **jit_kwargs)


def constrain(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """Pin an activation's sharding by its logical axis names (a no-op outside `sharded_jit`)."""
    mesh = _TRACING_MESH.get()
    return x if mesh is None else jax.lax.with_sharding_constraint(x, logical_sharding(names, x.shape, mesh))


def per_shard(fn, in_names: tuple, out_names: tuple[str | None, ...]):
    """fn run on each device's shard of arrays laid out by logical names (jax.shard_map), for
    kernels XLA cannot partition (Pallas); fn itself outside `sharded_jit`."""
    mesh = _TRACING_MESH.get()
    if mesh is None:
        return fn

    def run(*arrays):
        specs = tuple(logical_spec(names, x.shape, mesh) for names, x in zip(in_names, arrays))
        out_spec = logical_spec(out_names, arrays[0].shape, mesh)
        return jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=out_spec, check_vma=False)(*arrays)

    return run


def shards(name: str, size: int) -> int:
    """Into how many pieces the rules split a dimension of `size` named `name` (1 outside `sharded_jit`)."""
    mesh = _TRACING_MESH.get()
    if mesh is None:
        return 1
    axes = logical_spec((name,), (size,), mesh)[0] or ()
    return math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))


def describe(mesh: Mesh) -> str:
    return "mesh " + " ".join(f"{a}={mesh.shape[a]}" for a in AXES)


def data_parallel_size(mesh: Mesh) -> int:
    return int(np.prod([mesh.shape[a] for a in RULES["act_batch"]]))
