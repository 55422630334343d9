"""The named mesh `data x stage x fsdp x context x expert x tensor`, inside a slice and across slices: its shape
resolved and checked against the devices.

What each axis shards is `podtrain.sharding`'s business; this module only builds the mesh."""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from podtrain.axes import AXES, DCN_AXES
from podtrain.config.parallel import MeshConfig
from podtrain.errors import MeshError


def factorizations(n: int, axes: int = 3) -> list[tuple[int, ...]]:
    """Every way to write n as an ordered product of `axes` factors, the first factor largest first."""
    if axes == 1:
        return [(n,)]
    return [(d, *rest) for d in range(n, 0, -1) if n % d == 0 for rest in factorizations(n // d, axes - 1)]


def _resolve(sizes: dict[str, int], n: int, what: str, keys: str) -> dict[str, int]:
    """`sizes` with its -1 given the rest of n; an error naming the valid shapes if they do not make n."""
    named = " ".join(f"{keys}{a}={s}" for a, s in sizes.items())
    valid = ", ".join("x".join(map(str, f)) for f in factorizations(n, len(sizes))[:10])
    hint = f"Valid {' x '.join(sizes)} shapes for {n} {what} include {valid}; -1 on one axis takes the rest."
    values = list(sizes.values())
    if values.count(-1) > 1 or any(s == 0 or s < -1 for s in values):
        raise MeshError(f"Mesh {named} is invalid: sizes must be positive, with at most one -1. {hint}")
    known = math.prod(s for s in values if s != -1)
    if -1 in values:
        if n % known:
            raise MeshError(f"Mesh {named}: {n} {what} cannot be split into a multiple of {known}. {hint}")
        values[values.index(-1)] = n // known
    elif known != n:
        raise MeshError(f"Mesh {named} needs {known} {what} but {n} are available. {hint}")
    return dict(zip(sizes, values))


def split_shape(mesh: MeshConfig, n_devices: int, n_slices: int = 1) -> tuple[dict[str, int], dict[str, int]]:
    """Each axis's size within a slice and its number of slices (AXES order). With every dcn_ size
    1 the mesh is one slice of all the devices; one slice with dcn_ sizes (fake devices) is split
    into as many as they ask."""
    dcn = {a: getattr(mesh, f"dcn_{a}") if a in DCN_AXES else 1 for a in AXES}
    if all(s == 1 for s in dcn.values()):
        n_slices = 1
    elif n_slices == 1:
        n_slices = math.prod(s for s in dcn.values() if s != -1)
    dcn = _resolve(dcn, n_slices, "slices", "dcn_")
    if n_devices % n_slices:
        raise MeshError(f"{n_devices} devices do not split evenly into {n_slices} slices.")
    what = "devices per slice" if n_slices > 1 else "devices"
    return _resolve({a: getattr(mesh, a) for a in AXES}, n_devices // n_slices, what, ""), dcn


def resolve_shape(mesh: MeshConfig, n_devices: int, n_slices: int = 1) -> dict[str, int]:
    """Each axis's size over all the devices: within a slice times across slices."""
    ici, dcn = split_shape(mesh, n_devices, n_slices)
    return {a: ici[a] * dcn[a] for a in AXES}


def slices(devices: list[jax.Device]) -> list[list[jax.Device]]:
    """The devices by slice: a TPU's slice_index; off a TPU, by process (a GPU host's devices)."""
    key = "slice_index" if devices[0].platform == "tpu" else "process_index"
    groups: dict[int, list] = {}
    for d in devices:
        groups.setdefault(getattr(d, key, 0), []).append(d)
    return [groups[k] for k in sorted(groups)]


def _grid(shape: tuple[int, ...], devices: list[jax.Device]) -> np.ndarray:
    """`devices` as an array of `shape`, laid on a TPU torus by its physical axes; a shape they do
    not factor into (8 x 8 on a 4x4x4 v5p-128) splits them."""
    try:
        return mesh_utils.create_device_mesh(shape, devices)
    except (NotImplementedError, ValueError, AssertionError):
        return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)


def build_mesh(mesh: MeshConfig, devices: list[jax.Device]) -> Mesh:
    """The mesh on `devices`: each slice's devices hold the axes' inner sizes (its fast links), and
    the slices, in a grid of the dcn_ sizes, the outer ones (the network between them)."""
    groups = slices(devices)
    ici, dcn = split_shape(mesh, len(devices), len(groups))
    auto = (jax.sharding.AxisType.Auto,) * len(AXES)
    n = math.prod(dcn.values())
    if n == 1 and len(groups) > 1 and devices[0].platform == "tpu":
        raise MeshError(
            f"The devices lie on {len(groups)} TPU slices, joined by the data-centre network: say which axes span "
            f"them, e.g. mesh.dcn_data={len(groups)} (data parallelism across slices, the usual choice)."
        )
    if n == 1:
        shape = tuple(ici.values())
        try:
            return jax.make_mesh(shape, AXES, axis_types=auto, devices=devices)
        except NotImplementedError:
            return Mesh(_grid(shape, devices), AXES, axis_types=auto)
    if len(groups) == 1:  # one process's devices (fake ones in tests) as n slices
        size = len(devices) // n
        groups = [devices[i * size : (i + 1) * size] for i in range(n)]
    elif len(groups) != n or len({len(g) for g in groups}) != 1:
        how = "slice_index" if devices[0].platform == "tpu" else "process"
        raise MeshError(
            f"The mesh asks for {n} slices ({' '.join(f'dcn_{a}={dcn[a]}' for a in DCN_AXES)}), and the devices "
            f"lie on {len(groups)} (by {how}: {', '.join(str(len(g)) for g in groups)} devices). Make the dcn_ sizes "
            f"multiply to {len(groups)}, or set them all to 1 for one mesh over every device."
        )
    cells = np.empty(tuple(dcn.values()), dtype=object)
    for index, group in zip(np.ndindex(cells.shape), groups):
        cells[index] = _grid(tuple(ici.values()), group)
    return Mesh(np.block(cells.tolist()), AXES, axis_types=auto)


def describe(mesh: Mesh, config: MeshConfig | None = None) -> str:
    """`mesh data=8 ...`; with slices, an axis across them as `data=2x4` (slices x devices in each)."""
    dcn = {a: getattr(config, f"dcn_{a}", 1) for a in DCN_AXES} if config else {}
    sizes = {a: f"{dcn[a]}x{mesh.shape[a] // dcn[a]}" if dcn.get(a, 1) > 1 else str(mesh.shape[a]) for a in AXES}
    n = math.prod(dcn.values()) if dcn else 1
    on = f" on {n} slices of {mesh.devices.size // n} devices" if n > 1 else ""
    return "mesh " + " ".join(f"{a}={s}" for a, s in sizes.items()) + on
