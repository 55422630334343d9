"""The named mesh `data x fsdp x tensor`: its shape resolved and checked against the devices.

What each axis shards is `podtrain.sharding`'s business; this module only builds the mesh."""

from __future__ import annotations

import math

import jax
from jax.sharding import Mesh

from podtrain.config.schema import MeshConfig
from podtrain.errors import MeshError
from podtrain.sharding import AXES


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


def describe(mesh: Mesh) -> str:
    return "mesh " + " ".join(f"{a}={mesh.shape[a]}" for a in AXES)
