"""A small model, and a few training steps of it on a chosen set of devices, outside the CLI."""

import jax
import numpy as np
from podtrain.config.load import load_config
from podtrain.runtime.mesh import build_mesh
from podtrain.train.job import build

# A model small enough for 2 CPU cores, with grouped-query attention (n_kv_heads < n_heads).
SMALL = [
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.d_ff=64",
    "model.max_seq_len=32",
    "train.seq_len=32",
    "train.batch_size=8",
    "model.compute_dtype=float32",
    "device_type=cpu",
]


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
