"""The state kept in host memory, written out by the survivors when a process of the job is lost.

Every checkpoint.replica_every steps each process copies the shards of the state its devices hold
into host memory. When the watchdog (podtrain.runtime.peers) finds a process lost, each survivor
writes, before it exits, the shards no survivor of lower index holds, to
CHECKPOINT_DIR/replica/<step>/process_<i>.npz. Where the survivors together hold every shard (any
data-parallel replica complete among them), the restart resumes from that step, not from the newest
checkpoint: it assembles the arrays, places them on its own mesh, and saves them as an ordinary
checkpoint at once. A step the files do not cover whole is passed over.

The copy is taken after the step: the state a failing step was given is donated to it, so once a
step has failed there is nothing left on the devices to save.
"""

from __future__ import annotations

import io
import shutil

import jax
import numpy as np

from podtrain import storage
from podtrain.trees import ITEMS, leaf_name

FOLDER = "replica"


def _key(name: str, index: tuple[slice, ...]) -> str:
    return f"{name}|{','.join(f'{s.start or 0}:{s.stop}' for s in index)}"


def _index(text: str, shape: tuple[int, ...]) -> tuple[slice, ...]:
    bounds = [part.split(":") for part in text.split(",")] if text else []
    return tuple(slice(int(a), None if b == "None" else int(b)) for a, b in bounds) or tuple(slice(None) for _ in shape)


class HostCopy:
    """The newest copy of this process's shards of the state, and how to write the part it alone keeps."""

    def __init__(self, directory: str):
        self.directory = storage.join(directory, FOLDER)
        self.kept, self.holders = None, {}  # (step, {shard key: host array}), replaced whole

    def keep(self, state: dict) -> None:
        leaves = jax.tree_util.tree_flatten_with_path({k: v for k, v in state.items() if k in ITEMS})[0]
        if not self.holders:  # which processes hold each shard (the layout stays), to write each once
            for path, x in leaves:
                for device, index in x.sharding.devices_indices_map(x.shape).items():
                    self.holders.setdefault(_key(leaf_name(path), index), set()).add(device.process_index)
        arrays = {}
        for path, x in leaves:
            for shard in x.addressable_shards:
                arrays.setdefault(_key(leaf_name(path), shard.index), shard.data)
        self.kept = int(jax.device_get(state["step"])), {k: np.asarray(v) for k, v in arrays.items()}

    def write(self, index: int, survivors: list[int]) -> None:
        """The shards of the kept step that no survivor of lower index holds, in one file."""
        if self.kept is None:
            return
        step, arrays = self.kept
        mine = {k: a for k, a in arrays.items() if min(set(survivors) & self.holders[k]) == index}
        buffer = io.BytesIO()
        np.savez(buffer, **mine)
        folder = storage.join(self.directory, str(step))
        storage.makedirs(folder)
        storage.write_bytes(storage.join(folder, f"process_{index}.npz"), buffer.getvalue())


def newest(directory: str, abstract: dict, after: int | None) -> tuple[int, dict] | None:
    """(step, state as host arrays) of the newest replica past step `after` whose files cover every
    array of `abstract` whole; None where there is none."""
    folder = storage.path(storage.join(directory, FOLDER))
    steps = sorted((int(p.name) for p in folder.iterdir() if p.name.isdigit()), reverse=True) if folder.is_dir() else []
    leaves = jax.tree_util.tree_flatten_with_path(abstract)[0]
    for step in (s for s in steps if after is None or s > after):
        pieces = {}
        for file in (folder / str(step)).iterdir():
            with np.load(io.BytesIO(file.read_bytes())) as npz:
                pieces.update({k: npz[k] for k in npz.files})
        arrays, whole = {}, True
        for path, x in leaves:
            name = leaf_name(path)
            full, covered = np.zeros(x.shape, x.dtype), np.zeros(x.shape, bool)
            for key, piece in pieces.items():
                if key.split("|")[0] == name:
                    index = _index(key.split("|", 1)[1], x.shape)
                    full[index], covered[index] = piece, True
            whole &= bool(covered.all())
            arrays[name] = full
        if whole:
            return step, jax.tree_util.tree_unflatten(
                jax.tree_util.tree_structure(abstract), [arrays[leaf_name(p)] for p, _ in leaves]
            )
    return None


def place(host: dict, abstract: dict) -> dict:
    """Host arrays placed on the devices as `abstract`'s shardings say."""
    return jax.tree.map(
        lambda a, x: jax.make_array_from_callback(x.shape, x.sharding, lambda index: a[index]), host, abstract
    )


def discard(directory: str) -> None:
    """The replicas, once a checkpoint holds their step (process 0)."""
    folder = storage.path(storage.join(directory, FOLDER))
    if storage.is_remote(folder):
        if folder.exists():
            folder.rmtree()
    else:
        shutil.rmtree(folder, ignore_errors=True)
