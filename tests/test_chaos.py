"""A run killed with SIGKILL at random moments, some of them during an async save, and rerun
each time, ends bitwise equal to the same run uninterrupted, with each step logged once."""

import os
import random
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from podtrain.program.job import build
from podtrain.program.load import load_config
from podtrain.runtime.mesh import build_mesh
from podtrain.train.checkpoint import Checkpointer
from podtrain.train.loop import train
from podtrain.train.metrics import read_metrics

from helpers import CLEAN_ENV, SMALL

STEPS = 30
ARGS = [
    *SMALL,
    f"train.steps={STEPS}",
    "train.ema=0.9",
    "train.log_every=1",
    "checkpoint.every=2",
    "train.eval_every=0",
    "train.eval_batches=1",
    "train.sample_tokens=0",
]


def _listing(checkpoints) -> tuple[set[int], bool]:
    """The complete steps, and whether a save is under way (orbax writes a step into a temporary
    folder, renamed at the end)."""
    names = [p.name for p in checkpoints.iterdir()] if checkpoints.is_dir() else []
    return {int(n) for n in names if n.isdigit()}, any("tmp" in n for n in names)


def _run(run, kill_after: int | None, delay: float) -> tuple[int | None, bool]:
    """Run the job on the 8 devices of the reference; with `kill_after`, SIGKILL it `delay` s after
    a checkpoint at or past that step is complete (often during the next save).
    Returns (its exit code, or None if killed; whether a save was under way at the kill)."""
    with open(run.parent / "chaos.log", "a") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "podtrain", "train", *ARGS, f"run_dir={run}"],
            env={**CLEAN_ENV, "XLA_FLAGS": os.environ["XLA_FLAGS"]},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    while process.poll() is None:
        if kill_after is not None and max(_listing(run / "checkpoints")[0], default=0) >= kill_after:
            time.sleep(delay)
            saving = _listing(run / "checkpoints")[1]
            process.send_signal(signal.SIGKILL)
            process.wait()
            return None, saving
        time.sleep(0.002)
    return process.returncode, False


def _state(run, cfg):
    job = build(cfg, build_mesh(cfg.mesh, jax.devices()))
    checkpointer = Checkpointer(run / "checkpoints")
    state = checkpointer.restore({k: v for k, v in job.abstract_state.items() if k != "step"})
    checkpointer.close()
    return jax.device_get(state)


@pytest.mark.integration
def test_sigkill_at_random_moments_then_rerun_ends_bitwise_equal(tmp_path):
    cfg = load_config(None, [*ARGS, f"run_dir={tmp_path / 'reference'}"])
    train(cfg)
    chaos, rng = tmp_path / "chaos", random.Random(12)
    chaos.mkdir()
    kill_points = sorted(rng.sample(range(2, STEPS, 2), 4))  # checkpoint steps, one kill after each
    outcomes = [_run(chaos, step, rng.uniform(0, 0.15)) for step in kill_points]
    code, _ = _run(chaos, None, 0)
    assert code == 0, (tmp_path / "chaos.log").read_text()[-3000:]
    kills, kills_in_a_save = sum(c is None for c, _ in outcomes), sum(saving for _, saving in outcomes)
    print(f"{kills} kills, {kills_in_a_save} of them during a save, after checkpoints {kill_points}")
    assert kills >= 3 and kills_in_a_save >= 1, (kills, kills_in_a_save)

    reference, resumed = _state(tmp_path / "reference", cfg), _state(chaos, cfg)
    assert int(resumed["step"]) == STEPS
    jax.tree.map(np.testing.assert_array_equal, resumed, reference)  # params, optimizer moments, EMA
    logged = [r for r in read_metrics(chaos) if "loss" in r]
    assert [r["step"] for r in logged] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in logged] == [r["loss"] for r in read_metrics(tmp_path / "reference") if "loss" in r]
