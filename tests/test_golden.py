"""Golden metrics: two train steps of each model family, in a tiny float32 config on one CPU device
from a fixed seed, give the loss, gradient norm and (HRM, TRM) puzzle metrics written below.

The step is the one `train` runs: config, job, initial state, jitted step. The batches are made
here by arithmetic, not read through the loader, so that only the numerics of the models, losses
and optimizer move these values. A change that moves one is either a bug or an intended change
of numerics; in the second case, update the value (the failure prints the new one).
"""

import math

import jax
import numpy as np
import pytest
from podtrain.program.checks import resolve_auto
from podtrain.program.job import build
from podtrain.program.load import load_config
from podtrain.runtime.mesh import build_mesh

from helpers import SMALL

# Run to run the metrics are bit-identical. They are those of the tests' compiles (compile_flags.py),
# which XLA's full optimisation, as `train` compiles, moves by up to 3e-5 relative.
RTOL = 1e-5
LANGUAGE = [*SMALL, "mesh.data=1", "train.lr=3e-3"]
PUZZLES = [
    "model.d_model=32",
    "model.n_heads=2",
    "model.d_ff=64",
    "model.H_cycles=2",
    "model.L_cycles=1",
    "model.halt_max_steps=2",
    "model.L_layers=1",
    "model.compute_dtype=float32",
    "device_type=cpu",
    "train.batch_size=8",
    "train.lr=1e-2",
    "train.warmup_steps=0",
    "mesh.data=1",
    "data.source=sudoku",
    "data.path=unused",  # the batches are made here
]
CONFIGS = {
    "llama": LANGUAGE,
    "mhc": [*LANGUAGE, "model.name=mhc", "model.streams=4"],
    "hrm": [*PUZZLES, "model.name=hrm", "model.H_layers=1"],
    "trm": [*PUZZLES, "model.name=trm", "model.puzzle_emb_len=4"],
}

# Per family, the metrics of step 1 and of step 2. HRM and TRM halt no slot at step 1 (q_halt starts
# at -5), so their accuracies and ACT steps are those of step 2, where every slot reaches halt_max_steps.
NAN = math.nan  # no slot halted, so nothing was counted
GOLDEN = {
    "llama": [
        {"loss": 5.552092552185059, "grad_norm": 1.7645529508590698, "lr": 0.00015000003622844815},
        {"loss": 5.526431083679199, "grad_norm": 1.733030915260315, "lr": 0.0003000000724568963},
    ],
    "mhc": [
        {"loss": 5.552239418029785, "grad_norm": 1.7887450456619263, "lr": 0.00014999997802078724},
        {"loss": 5.52620792388916, "grad_norm": 1.7566757202148438, "lr": 0.00030000018887221813},
    ],
    "hrm": [
        {
            "loss": 2.6720223426818848,
            "grad_norm": 1.7132155895233154,
            "lr": 0.009999444708228111,
            "lm_loss": 2.6485748291015625,
            "q_halt_loss": 0.006715348921716213,
            "q_continue_loss": 0.04017960652709007,
            "cell_accuracy": NAN,
            "exact_accuracy": NAN,
            "act_steps": NAN,
            "halted": 0.0,
        },
        {
            "loss": 2.3844947814941406,
            "grad_norm": 0.6098009943962097,
            "lr": 0.009997778572142124,
            "lm_loss": 2.3638999462127686,
            "q_halt_loss": 0.005657400004565716,
            "q_continue_loss": 0.03553244099020958,
            "cell_accuracy": 0.040123455226421356,
            "exact_accuracy": 0.0,
            "act_steps": 2.0,
            "halted": 1.0,
        },
    ],
    "trm": [
        {
            "loss": 2.7625277042388916,
            "grad_norm": 1.459136962890625,
            "lr": 0.009999444708228111,
            "lm_loss": 2.7591700553894043,
            "q_halt_loss": 0.006715348921716213,
            "cell_accuracy": NAN,
            "exact_accuracy": NAN,
            "act_steps": NAN,
            "halted": 0.0,
        },
        {
            "loss": 2.3684048652648926,
            "grad_norm": 0.8659027814865112,
            "lr": 0.009997778572142124,
            "lm_loss": 2.3655805587768555,
            "q_halt_loss": 0.005648624151945114,
            "cell_accuracy": 0.1111111119389534,
            "exact_accuracy": 0.0,
            "act_steps": 2.0,
            "halted": 1.0,
        },
    ],
}


def text_batch(step: int, batch: int, seq_len: int) -> np.ndarray:
    """Windows of seq_len + 1 bytes of a fixed text, consecutive like the loader's, (1, batch, seq + 1)."""
    text = " ".join(f"{i} squared is {i * i}, and {i} cubed is {i**3}." for i in range(60)).encode()
    tokens = np.frombuffer(text, np.uint8).astype(np.int32)
    starts = (step * batch + np.arange(batch)) * seq_len
    assert starts[-1] + seq_len + 1 <= len(tokens)
    return tokens[starts[:, None] + np.arange(seq_len + 1)][None]


def puzzle_batch(step: int, batch: int) -> np.ndarray:
    """(1, batch, 163) rows [puzzle id 0, 81 input tokens, 81 label tokens] (blank 1, digit d -> d + 1).
    Row k's solution is the solved grid (3r + r // 3 + c) mod 9, its digits shifted by k and
    transposed for odd k; a fixed pattern blanks about half of its cells."""
    r, c = np.arange(9)[:, None], np.arange(9)[None, :]
    rows = []
    for k in range(step * batch, (step + 1) * batch):
        solution = (3 * r + r // 3 + c + k) % 9 + 1
        solution = (solution.T if k % 2 else solution).ravel()
        blank = (np.arange(81) * 7 + 3 * k) % 11 < 5
        rows.append(np.concatenate([[0], np.where(blank, 0, solution) + 1, solution + 1]))
    return np.asarray(rows, np.int32)[None]


def two_steps(name: str) -> list[dict]:
    cfg = resolve_auto(load_config(None, CONFIGS[name]), "cpu")
    job = build(cfg, build_mesh(cfg.mesh, jax.devices()[:1]), data=False)
    t = cfg.train
    state = job.init_state(cfg.seed)
    out = []
    for step in range(2):
        rows = puzzle_batch(step, t.batch_size) if name in ("hrm", "trm") else text_batch(step, t.batch_size, t.seq_len)
        assert rows.shape == job.task.train_batch.shape
        state, metrics = job.step(state, jax.device_put(rows, job.task.train_batch.sharding))
        out.append({k: float(v) for k, v in jax.device_get(metrics).items()})
    return out


@pytest.mark.parametrize("name", list(GOLDEN))
def test_two_steps_give_the_golden_metrics(name):
    for step, (golden, metrics) in enumerate(zip(GOLDEN[name], two_steps(name)), start=1):
        assert not metrics["skipped"]
        for key, value in golden.items():
            message = f"{key} moved; update the golden value only if the change is intended (step {step}, {name})"
            np.testing.assert_allclose(metrics[key], value, rtol=RTOL, atol=0, equal_nan=True, err_msg=message)
