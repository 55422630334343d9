"""Run a few training steps on a chosen set of devices, outside the CLI; what no command may print."""

import jax
import numpy as np
from podtrain.config.load import load_config
from podtrain.runtime.mesh import build_mesh
from podtrain.train.job import build

# What libtpu prints when JAX wakes it on a machine without a TPU, and JAX's persistent-cache
# warning: no command may show them.
NOISE = ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "InitGoogle", "E0000", "persistent compilation cache")


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
