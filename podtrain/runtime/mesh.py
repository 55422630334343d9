"""The named mesh `data x fsdp x context x expert x tensor`: its shape resolved and checked against the devices.

What each axis shards is `podtrain.sharding`'s business; this module only builds the mesh."""

from __future__ import annotations

import math

import jax
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from podtrain.config.schema import MeshConfig
from podtrain.errors import MeshError
from podtrain.sharding import AXES


def factorizations(n: int, axes: int = 3) -> list[tuple[int, ...]]:
    """Every way to write n as an ordered product of `axes` factors, the first factor largest first."""
    if axes == 1:
        return [(n,)]
    return [(d, *rest) for d in range(n, 0, -1) if n % d == 0 for rest in factorizations(n // d, axes - 1)]


def resolve_shape(mesh: MeshConfig, n_devices: int) -> dict[str, int]:
    """Each axis's size (in AXES order), the -1 one given the rest of the devices."""
    sizes = [getattr(mesh, a) for a in AXES]
    named = " ".join(f"{a}={s}" for a, s in zip(AXES, sizes))
    valid = ", ".join("x".join(map(str, s)) for s in factorizations(n_devices, len(AXES))[:10])
    hint = f"Valid {' x '.join(AXES)} shapes for {n_devices} devices include {valid}; -1 on one axis takes the rest."
    if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
        raise MeshError(f"Mesh {named} is invalid: sizes must be positive, with at most one -1. {hint}")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if n_devices % known:
            raise MeshError(f"Mesh {named}: {n_devices} devices cannot be split into a multiple of {known}. {hint}")
        sizes[sizes.index(-1)] = n_devices // known
    elif known != n_devices:
        raise MeshError(f"Mesh {named} needs {known} devices but {n_devices} are available. {hint}")
    return dict(zip(AXES, sizes))


def build_mesh(mesh: MeshConfig, devices: list[jax.Device]) -> Mesh:
    """The mesh on `devices`, laid on a TPU torus by its physical axes; a shape they do not factor
    into (8 x 8 on a 4x4x4 v5p-128) splits them."""
    shape = tuple(resolve_shape(mesh, len(devices)).values())
    auto = (jax.sharding.AxisType.Auto,) * len(AXES)
    try:
        return jax.make_mesh(shape, AXES, axis_types=auto, devices=devices)
    except NotImplementedError:
        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
        return Mesh(grid, AXES, axis_types=auto)


def describe(mesh: Mesh) -> str:
    return "mesh " + " ".join(f"{a}={mesh.shape[a]}" for a in AXES)
