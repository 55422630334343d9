"""Async, sharded orbax checkpoints of the train state under CHECKPOINT_DIR/<step>, verified on restore.

Each entry of the state besides the step (params, opt, and ema when enabled) is its own item,
so `generate` can restore the weights alone; a `digest` item records the checksums of every
array (podtrain.train.digest). Restoring into abstract arrays with shardings places each shard
directly on its device, on whatever mesh the restoring job uses, and then checks the arrays
against the recorded checksums.

orbax writes a step into a temporary folder and renames it when complete, so a process killed
mid-save leaves no step behind, only a temporary folder that orbax ignores. A step whose files
were damaged afterwards fails its restore or its checksums: training sets it aside as
<step>.damaged (renamed, never deleted) and resumes from the newest intact step.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from contextlib import contextmanager
from datetime import UTC, datetime

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from podtrain import storage
from podtrain.errors import CheckpointError, SaveFailed, first_line
from podtrain.train import disk
from podtrain.train.digest import checksums, fingerprint
from podtrain.train.orbax_quiet import quiet_orbax
from podtrain.trees import ITEMS, leaf_name

DIGEST = "digest"


class CheckpointMismatch(CheckpointError):
    """A checkpoint whose arrays have other shapes than the state it is restored into."""

    def __init__(self, step: int, differences: list[str]):
        super().__init__(
            f"The checkpoint at step {step} holds other arrays than this config makes: {'; '.join(differences[:4])}."
        )
        self.step, self.differences = step, differences


class _Damaged(Exception):
    """A step whose files cannot be read back, or whose arrays differ from their checksums."""


def location(directory) -> str:
    """A checkpoint directory as orbax takes it: remote ones (gs://...) untouched, local ones absolute."""
    directory = str(directory)
    return directory if "://" in directory else os.path.abspath(directory)


def _first_line(e: Exception) -> str:
    return first_line(e).split(" See full TensorStore details")[0]


def _agree(ok: bool) -> bool:
    """Whether every process found `ok`; each reads its own shards, so one may fail alone."""
    return ok if jax.process_count() == 1 else bool(multihost_utils.process_allgather(np.int32(ok)).min())


def _shapes(tree) -> dict[str, tuple]:
    return {
        leaf_name(p): (tuple(x.shape), np.dtype(x.dtype).name) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def _differences(saved: dict, wanted: dict) -> list[str]:
    out = [
        f"{k} is {saved[k][1]}{list(saved[k][0])} there, {wanted[k][1]}{list(wanted[k][0])} here"
        for k in wanted
        if k in saved and saved[k] != wanted[k]
    ]
    out += [f"{k} is not in it" for k in wanted if k not in saved]
    return out + [f"{k} is in it but not in this state" for k in saved if k not in wanted]


# orbax splits the writing of a replicated shard between its replicas, each slicing its part on
# the device: one small compile per array shape and slice, about 30 ms each on a CPU, which made a
# small model's first save take seconds. Slices under this size are written whole by one replica.
MIN_REPLICA_SLICE_BYTES = 16 * 2**20


@functools.cache
def _whole_small_slices() -> None:
    """orbax's array handler with MIN_REPLICA_SLICE_BYTES, once per process, without the warning
    orbax logs on replacing its default handler (which is the point here)."""
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        ocp.type_handlers.register_type_handler(
            jax.Array,
            ocp.type_handlers.ArrayHandler(min_slice_bytes_for_replica_parallel=MIN_REPLICA_SLICE_BYTES),
            override=True,
        )
    finally:
        absl.setLevel(level)


class Checkpointer:
    def __init__(self, directory, keep: int = 3, async_save: bool = True):
        quiet_orbax()  # of the faults podtrain reports itself: damaged steps, full disks, saves cut short
        _whole_small_slices()
        self.directory = location(directory)
        self.pending, self.needed, self.warned = None, 0, False  # the last step saved; its bytes; space warned of
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=True)
        try:
            # Handlers for every item, so that a fresh manager reads any checkpoint's metadata.
            handlers = {
                **{name: ocp.StandardCheckpointHandler() for name in ITEMS},
                DIGEST: ocp.JsonCheckpointHandler(),
            }
            self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        except Exception as e:  # an unreachable bucket, a file in the way, no permission
            raise CheckpointError(
                f"Cannot open the checkpoint directory {self.directory}: {_first_line(e)}. Check checkpoint.dir."
            ) from None

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, state: dict) -> None:
        step = int(jax.device_get(state["step"]))
        self.wait()  # a failed earlier save is reported as its own step's
        arrays = {name: tree for name, tree in state.items() if name in ITEMS}  # not LoRA's base: init_from's
        self.needed = sum(x.nbytes for x in jax.tree.leaves(arrays))
        if (
            not self.warned
            and jax.process_index() == 0
            and (warning := disk.short_of_space(self.directory, self.needed, step))
        ):
            print(warning, file=sys.stderr, flush=True)
            self.warned = True
        items = {name: ocp.args.StandardSave(tree) for name, tree in arrays.items()}
        items[DIGEST] = ocp.args.JsonSave(checksums(arrays))
        self.pending = step
        with self.writing():
            self.manager.save(step, args=ocp.args.Composite(**items))

    def wait(self) -> None:
        with self.writing():
            self.manager.wait_until_finished()

    @contextmanager
    def writing(self):
        """A full disk, or a bucket that failed through every retry, under the pending save becomes one
        paragraph, not orbax's tracebacks."""
        try:
            yield
        except Exception as e:
            if storage.is_remote(self.directory) and not isinstance(e, CheckpointError):
                intact = self.latest_step()
                raise SaveFailed(
                    f"The checkpoint of step {self.pending} could not be written to {self.directory}: "
                    f"{_first_line(e)}. It was never marked complete; the newest complete checkpoint is step "
                    f"{intact}. Run the same command again to resume from it once the storage answers."
                ) from None
            if not disk.is_full(e):
                raise
            if jax.process_index() == 0:
                disk.remove_partial(self.directory, self.pending)
            raise disk.full_disk(self.pending, self.directory, self.needed, self.latest_step()) from None

    def _restore_step(self, step: int, abstract: dict) -> dict:
        """The items of `abstract` at `step`, checked against their checksums. Every process
        reaches the one agreement below, whichever of them failed to read."""
        try:
            metadata = self.manager.item_metadata(step)
            saved = {
                name: _shapes(getattr(metadata[name], "tree", metadata[name]))
                for name in abstract
                if metadata.get(name) is not None
            }
        except Exception as e:
            error = f"its metadata cannot be read ({_first_line(e)})"
        else:
            for name, tree in abstract.items():  # shapes first: a different model is the user's to fix, not damage
                differences = _differences(saved.get(name, {}), _shapes(tree))
                if differences:
                    raise CheckpointMismatch(step, [f"{name}/{d}" for d in differences])
            items = {name: ocp.args.StandardRestore(tree) for name, tree in abstract.items()}
            try:
                restored, error = (
                    self.manager.restore(step, args=ocp.args.Composite(**items, **{DIGEST: ocp.args.JsonRestore()})),
                    None,
                )
            except Exception as e:  # truncated or missing files; tensorstore and orbax raise many kinds
                error = f"its files cannot be read ({_first_line(e)})"
        if not _agree(error is None):
            raise _Damaged(error or "another process cannot read its files")
        recorded = restored[DIGEST] or {}
        found = checksums({name: restored[name] for name in abstract})
        wrong = [path for path, sums in found.items() if recorded.get(path) != sums]
        if wrong:
            raise _Damaged(
                f"{len(wrong)} of its {len(found)} arrays differ from their recorded checksums, e.g. {wrong[0]}"
            )
        return {name: restored[name] for name in abstract}

    def restore(self, abstract: dict, set_aside: bool = False, say=lambda line: print(line, file=sys.stderr)) -> dict:
        """The items named in `abstract` (e.g. {"params": ...}) of the newest intact step, onto
        their shardings, with "step". Newer damaged steps are reported and, with `set_aside`,
        renamed to <step>.damaged so that training continues from the intact one."""
        damaged = []
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                state = self._restore_step(step, abstract)
            except _Damaged as e:
                damaged.append((step, str(e)))
                say(f"[podtrain] the checkpoint at step {step} is damaged: {e}.")
                continue
            if damaged:
                if set_aside:
                    self._set_aside([s for s, _ in damaged])
                say(
                    f"[podtrain] resuming from step {step}, the newest intact checkpoint"
                    + (f"; set aside as {', '.join(f'{s}.damaged' for s, _ in damaged)}." if set_aside else ".")
                )
            mesh = jax.tree.leaves(abstract)[0].sharding.mesh
            return {**state, "step": jax.device_put(jnp.int32(step), NamedSharding(mesh, PartitionSpec()))}
        if damaged:
            listing = "; ".join(f"step {s}: {why}" for s, why in damaged)
            raise CheckpointError(
                f"No intact checkpoint in {self.directory} ({listing}). Nothing was renamed or deleted; "
                "move them away to start afresh, or use a new run_dir."
            )
        raise CheckpointError(f"No checkpoint in {self.directory}; train first (podtrain train ... run_dir=...).")

    def holds(self, step: int, item: str) -> bool:
        """Whether `step` saved `item` (e.g. "opt": a training state, not weights alone); a step
        whose metadata cannot be read says yes, so that its restore reports the damage."""
        try:
            return self.manager.item_metadata(step).get(item) is not None
        except Exception:  # noqa: BLE001 - reported by the restore that follows
            return True

    def restore_weights(self, abstract_params, step: int | None = None) -> tuple[int, object]:
        """(step, weights onto `abstract_params`) of `step`, or of the newest intact step: its EMA
        where it kept one."""
        if step is None:
            latest = self.latest_step()  # none: restore says so
            name = "ema" if latest is not None and self.holds(latest, "ema") else "params"
            state = self.restore({name: abstract_params})
            return int(state["step"]), state[name]
        if step not in (steps := self.manager.all_steps()):
            raise CheckpointError(
                f"No checkpoint at step {step} in {self.directory}; it has steps {sorted(steps) or 'none'}."
            )
        name = "ema" if self.holds(step, "ema") else "params"
        try:
            return step, self._restore_step(step, {name: abstract_params})[name]
        except _Damaged as e:
            raise CheckpointError(f"The checkpoint at step {step} in {self.directory} is damaged: {e}.") from None

    def _set_aside(self, steps: list[int]) -> None:
        if jax.process_index() == 0:
            for step in steps:
                folder = epath.Path(self.directory) / str(step)
                target, n = folder.parent / f"{step}.damaged", 1
                while target.exists():  # a step damaged again after an earlier set-aside
                    target, n = folder.parent / f"{step}.damaged.{n}", n + 1
                folder.rename(target)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("podtrain: damaged checkpoints set aside")
        self.manager.reload()

    def close(self) -> None:
        self.wait()
        self.manager.close()


def _size(folder: epath.Path) -> int:
    return sum(_size(p) if p.is_dir() else p.stat().length for p in folder.iterdir())


def _committed(folder: epath.Path) -> float:
    """When a step was committed: its folder's time, or in a bucket (whose folders have none) that of the
    metadata orbax writes as it commits."""
    return folder.stat().mtime or (folder / "_CHECKPOINT_METADATA").stat().mtime


def describe(directory) -> list[dict]:
    """Each checkpoint's step, commit time, size, fingerprint of its checksums, and whether it
    verifies, restoring one item at a time onto this host's first device."""
    if not epath.Path(location(directory)).exists():
        raise CheckpointError(
            f"No checkpoints at {location(directory)}; train first, or give the run_dir of a run that saved some."
        )
    checkpointer = Checkpointer(directory)
    mesh = Mesh(np.array(jax.devices()[:1]), ("all",))
    single = NamedSharding(mesh, PartitionSpec())
    rows = []
    for step in checkpointer.manager.all_steps():
        folder = epath.Path(checkpointer.directory) / str(step)
        row = {
            "step": step,
            "time": datetime.fromtimestamp(_committed(folder), UTC).isoformat(timespec="seconds"),
            "bytes": _size(folder),
        }
        try:
            recorded = checkpointer.manager.restore(step, args=ocp.args.Composite(**{DIGEST: ocp.args.JsonRestore()}))[
                DIGEST
            ]
            metadata = checkpointer.manager.item_metadata(step)
            names = [name for name in metadata.keys() if name != DIGEST and metadata[name] is not None]  # noqa: SIM118
            row["digest"] = fingerprint(recorded)
            for name in names:
                tree = getattr(metadata[name], "tree", metadata[name])
                checkpointer._restore_step(
                    step, {name: jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=single), tree)}
                )
            row["verified"], row["problem"] = True, None
        except Exception as e:  # damaged: reported, not raised
            row.setdefault("digest", None)
            row["verified"], row["problem"] = False, _first_line(e)
        rows.append(row)
    checkpointer.close()
    aside = epath.Path(checkpointer.directory)
    rows += [{"step": p.name, "set_aside": True} for p in sorted(aside.glob("*.damaged*"))] if aside.exists() else []
    return rows
