"""Run a few training steps on a chosen set of devices, outside the CLI."""

import jax
import numpy as np

from podtrain.config import load_config
from podtrain.data.loader import BatchReader, train_windows
from podtrain.data.text import load_tokens
from podtrain.runtime.mesh import build_mesh
from podtrain.train.state import init_state, train_setup
from podtrain.train.step import batch_sharding, make_train_step


def trainer(overrides, n_devices):
    """(initial state, jitted step, batches) for the config and mesh in `overrides`."""
    cfg = load_config(None, overrides)
    mesh = build_mesh(cfg.mesh, jax.devices()[:n_devices])
    setup = train_setup(cfg, mesh)
    t = cfg.train
    windows = train_windows(load_tokens(cfg.data)[0], t.seq_len, t.batch_size, cfg.seed)
    batches = BatchReader(windows, batch_sharding(mesh, leading=1), (t.grad_accum, t.batch_size // t.grad_accum, t.seq_len + 1), axis=1)
    return init_state(setup, cfg.seed), make_train_step(setup, t, mesh), batches


def run_steps(overrides, n_devices, n_steps=3):
    """Losses of n_steps and the final params (on host) for the mesh in `overrides`."""
    state, step, batches = trainer(overrides, n_devices)
    losses = []
    for i in range(n_steps):
        state, metrics = step(state, batches[i])
        losses.append(float(metrics["loss"]))
    return np.array(losses), jax.device_get(state["params"])
