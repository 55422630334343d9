"""A small model; a few training steps of it on a chosen set of devices, outside the CLI; podtrain in a
process of its own; what no command may print."""

import importlib.util
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from podtrain.models import MODELS
from podtrain.planning import gpus
from podtrain.program.job import build
from podtrain.program.load import load_config
from podtrain.runtime.mesh import build_mesh

from compile_flags import TEST_COMPILES

FAMILIES = tuple(MODELS)
LANGUAGE_FAMILIES = tuple(name for name, f in MODELS.items() if f.task == "language")

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
# HRM and TRM on Sudoku, small enough for 2 CPU cores (with data.source=sudoku data.path=DIR).
TINY = [
    "model.d_model=32",
    "model.n_heads=2",
    "model.d_ff=64",
    "model.compute_dtype=float32",
    "device_type=cpu",
    "train.batch_size=8",
    "train.lr=3e-3",
]
RECURSION = {
    "trm": [
        "model.name=trm",
        "model.H_cycles=2",
        "model.L_cycles=1",
        "model.puzzle_emb_len=4",
        "model.halt_max_steps=2",
    ],
    "hrm": [
        "model.name=hrm",
        "model.H_cycles=2",
        "model.L_cycles=1",
        "model.H_layers=1",
        "model.L_layers=1",
        "model.halt_max_steps=2",
    ],
}
# Ahead-of-time TPU compiles need the tpu extra (libtpu), which `make test` installs.
needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason="the tpu extra (libtpu) is not installed"
)
# GPU plans compile with XLA's GPU compiler, from JAX's CUDA plugin, which `make test` installs.
needs_cuda_compiler = pytest.mark.skipif(
    not gpus.installed(), reason="JAX's CUDA plugin is not installed (`make` puts it in .venv/cuda-compiler)"
)
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


# Children get their own fake device count from `launch`, no stray cluster variables, and the
# tests' unoptimised compiles (conftest.py).
LAUNCHER_VARS = ("XLA_FLAGS", "RANK", "WORLD_SIZE", "NODE_RANK", "NPROC_PER_NODE", "LOCAL_RANK")
CLEAN_ENV = {
    **{
        k: v
        for k, v in os.environ.items()
        if k not in LAUNCHER_VARS and not k.startswith(("JAX_", "MASTER_", "SLURM_", "OMPI_"))
    },
    "XLA_FLAGS": TEST_COMPILES,
}


def podtrain(*args, env=None, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "podtrain", *args],
        env={**CLEAN_ENV, **(env or {})},
        capture_output=True,
        text=True,
        **kwargs,
    )
