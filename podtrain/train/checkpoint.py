"""Async, sharded orbax checkpoints of the train state under CHECKPOINT_DIR/<step>.

Each entry of the state besides the step (params, opt, and ema when enabled) is its own item,
so `generate` can restore the weights alone.
Restoring into abstract arrays with shardings places each shard directly on its device, on
whatever mesh the restoring job uses.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec

from podtrain.errors import CheckpointError


class Checkpointer:
    def __init__(self, directory: Path, keep: int = 3, async_save: bool = True):
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=True)
        self.manager = ocp.CheckpointManager(Path(directory).absolute(), options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, state: dict) -> None:
        items = {name: ocp.args.StandardSave(tree) for name, tree in state.items() if name != "step"}
        self.manager.save(int(jax.device_get(state["step"])), args=ocp.args.Composite(**items))

    def restore(self, abstract: dict) -> dict:
        """The latest step and the items named in `abstract` (e.g. {"params": ...}), onto its shardings."""
        step = self.latest_step()
        if step is None:
            raise CheckpointError(f"No checkpoint in {self.manager.directory}; train first (podtrain train ... run_dir=...).")
        items = {name: ocp.args.StandardRestore(tree) for name, tree in abstract.items()}
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(
                f"The checkpoint at step {step} in {self.manager.directory} does not fit this model ({str(e).splitlines()[0][:300]}). "
                "Use the config it was trained with, or a new run_dir."
            ) from None
        mesh = jax.tree.leaves(abstract)[0].sharding.mesh
        state = {name: restored[name] for name in items}
        state["step"] = jax.device_put(jnp.int32(step), NamedSharding(mesh, PartitionSpec()))
        return state

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
