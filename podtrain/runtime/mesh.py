"""The named mesh `data x fsdp x tensor` and the one table that maps logical axes onto it."""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from podtrain.config import MeshConfig
from podtrain.errors import MeshError

AXES = ("data", "fsdp", "tensor")

# Logical axis -> mesh axes. Changing a model's parallelism is a change here, not in the model.
RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp"),
    "embed": ("fsdp",),
    "mlp": ("tensor",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "vocab": ("tensor",),
    "head_dim": (),
    "layers": (),
    "seq": (),
    "streams": (),  # mHC's residual streams and their mixing coefficients
}


def factorizations(n: int) -> list[tuple[int, int, int]]:
    return [(d, f, n // (d * f)) for d in range(n, 0, -1) if n % d == 0 for f in range(n // d, 0, -1) if (n // d) % f == 0]


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


def describe(mesh: Mesh) -> str:
    return "mesh " + " ".join(f"{a}={mesh.shape[a]}" for a in AXES)


def data_parallel_size(mesh: Mesh) -> int:
    return int(np.prod([mesh.shape[a] for a in RULES["batch"]]))
