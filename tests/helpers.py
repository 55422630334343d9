"""Run a few training steps on a chosen set of devices, outside the CLI; run podtrain in a process of its own."""

import os
import subprocess
import sys

import jax
import numpy as np
from podtrain.config.load import load_config
from podtrain.runtime.mesh import build_mesh
from podtrain.train.job import build


def trainer(overrides, n_devices):
    """(initial state, jitted step, batches) for the config and mesh in `overrides`."""
    cfg = load_config(None, overrides)
    mesh = build_mesh(cfg.mesh, jax.devices()[:n_devices])
    job = build(cfg, mesh)
    return job.init_state(cfg.seed), job.step, job.task.batches


def run_steps(overrides, n_devices, n_steps=3):
    """Losses of n_steps and the final params (on host) for the mesh in `overrides`."""
    state, step, batches = trainer(overrides, n_devices)
    losses = []
    for i in range(n_steps):
        state, metrics = step(state, batches[i])
        losses.append(float(metrics["loss"]))
    return np.array(losses), jax.device_get(state["params"])


# Children get their own fake device count from `launch`, and no stray cluster variables.
LAUNCHER_VARS = ("XLA_FLAGS", "RANK", "WORLD_SIZE", "NODE_RANK", "NPROC_PER_NODE", "LOCAL_RANK")
CLEAN_ENV = {
    k: v
    for k, v in os.environ.items()
    if k not in LAUNCHER_VARS and not k.startswith(("JAX_", "MASTER_", "SLURM_", "OMPI_"))
}


def podtrain(*args, env=None, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "podtrain", *args],
        env={**CLEAN_ENV, **(env or {})},
        capture_output=True,
        text=True,
        **kwargs,
    )
