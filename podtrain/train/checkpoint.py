"""Async, sharded orbax checkpoints of params and optimizer state under CHECKPOINT_DIR/<step>.

Params and optimizer state are separate items, so `generate` can restore params alone.
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
        self.manager.save(int(jax.device_get(state["step"])), args=ocp.args.Composite(params=ocp.args.StandardSave(state["params"]), opt=ocp.args.StandardSave(state["opt"])))

    def restore(self, abstract_params, abstract_opt=None) -> dict:
        """The latest {"step", "params"} and, given abstract_opt, "opt", onto the abstract shardings."""
        step = self.latest_step()
        if step is None:
            raise CheckpointError(f"No checkpoint in {self.manager.directory}; train first (podtrain train ... run_dir=...).")
        items = {"params": ocp.args.StandardRestore(abstract_params)}
        if abstract_opt is not None:
            items["opt"] = ocp.args.StandardRestore(abstract_opt)
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(
                f"The checkpoint at step {step} in {self.manager.directory} does not fit this model ({str(e).splitlines()[0][:300]}). "
                "Use the config it was trained with, or a new run_dir."
            ) from None
        mesh = jax.tree.leaves(abstract_params)[0].sharding.mesh
        state = {name: restored[name] for name in items}
        state["step"] = jax.device_put(jnp.int32(step), NamedSharding(mesh, PartitionSpec()))
        return state

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
