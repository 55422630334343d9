"""`podtrain eval`: a trained TRM run scored on every test puzzle for several halt_max_steps, as the
trainer's own evaluation scores it; records that metrics.jsonl's readers take; seeds pooled; errors."""

import dataclasses
import itertools
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from podtrain.cli import main
from podtrain.data import sudoku
from podtrain.program.load import load_config
from podtrain.program.saved import save_config
from podtrain.program.tasks.puzzles import evaluate_puzzles, split, stablemax_cross_entropy
from podtrain.train.metrics import MetricsLog, read_metrics
from podtrain.train.run import Run

from helpers import RECURSION, SMALL, TINY

SCORES = ("cell_accuracy", "exact_accuracy", "act_steps", "loss")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """trm_s1: a TRM run of 2 steps (halt_max_steps=2) with checkpoints at steps 1 and 2, on 12 test
    puzzles (a batch of 8 and one padded); trm_s0: a copy of it without the step-2 checkpoint, so
    two runs with different weights for the price of one."""
    base = tmp_path_factory.mktemp("eval")
    sudoku.build(base / "sudoku", "generate", n_train=16, n_test=12, givens=45, min_rating=0, copies=1, seed=0)
    overrides = [*TINY, *RECURSION["trm"], "data.source=sudoku", f"data.path={base / 'sudoku'}", "log.to=[jsonl]"]
    steps = ["train.steps=2", "checkpoint.every=1", "train.eval_batches=1"]
    assert main(["train", *overrides, *steps, f"run_dir={base / 'trm_s1'}"]) == 0
    shutil.copytree(base / "trm_s1", base / "trm_s0")
    shutil.rmtree(base / "trm_s0" / "checkpoints" / "2")
    return base


def evals(run) -> dict[int, dict]:
    """halt_max_steps -> the latest eval record of each value in the run's metrics.jsonl."""
    return {r["eval_halt_max_steps"]: r for r in read_metrics(run) if "eval_halt_max_steps" in r}


@pytest.fixture(scope="module")
def evaluated(runs) -> dict[int, dict]:
    """trm_s1 evaluated at halt_max_steps 1, 2 and 3: the records it logged."""
    assert main(["eval", str(runs / "trm_s1"), "--halt-max-steps", "1,2,3"]) == 0
    return evals(runs / "trm_s1")


def test_eval_scores_each_halt_value_and_logs_it(runs, evaluated, capsys, tmp_path):
    run = runs / "trm_s1"
    assert sorted(evaluated) == [1, 2, 3] and (run / "eval_recursion.png").is_file()
    for halt, r in evaluated.items():
        assert r["step"] == 2 and r["test_puzzles"] == 12
        assert 0 <= r["test_cell_accuracy"] <= 1 and 0 <= r["test_exact_accuracy"] <= 1
        assert 1 <= r["test_act_steps"] <= halt

    before = len(read_metrics(run))
    assert main(["eval", str(run), "--halt-max-steps", "1,2,3"]) == 0  # the same numbers again
    assert re.search(r"^\s+2 \*\s", capsys.readouterr().out, re.M)  # the trained value is marked
    assert len(read_metrics(run)) == before + 3 and evals(run) == evaluated
    assert main(["plot", str(run), "--out", str(tmp_path / "curves.png")]) == 0

    # A resume from the evaluated step keeps the records; one from an earlier step drops them.
    cfg = dataclasses.replace(Run.at(run).cfg, log=dataclasses.replace(Run.at(run).cfg.log, to=["jsonl"]))
    for start, kept in ((2, len([r for r in read_metrics(run) if "eval_halt_max_steps" in r])), (1, 0)):
        shutil.copy(run / "metrics.jsonl", tmp_path / "metrics.jsonl")
        MetricsLog(dataclasses.replace(cfg, run_dir=str(tmp_path)), start_step=start).close()
        assert len([r for r in read_metrics(tmp_path) if "eval_halt_max_steps" in r]) == kept


def segments(model, rows, last: int) -> dict:
    """The evaluation written out for one halt_max_steps: `last` segments, scored on the last, and
    the segment at which TRM's rule (q_halt > 0) or the limit first stops each puzzle."""
    ids, inputs, labels = split(rows)
    z, halt_at = model.initial_carry(len(rows)), jnp.zeros(len(rows), jnp.int32)
    for i in range(1, last + 1):
        z, logits, q = model(z, inputs, ids)
        halt_at = jnp.where((halt_at == 0) & ((q[:, 0] > 0) | (i == last)), i, halt_at)
    correct = jnp.argmax(logits, -1) == labels
    return {
        "val_cell_accuracy": correct.mean(),
        "val_exact_accuracy": correct.all(-1).mean(),
        "val_act_steps": halt_at.mean(),
        "val_loss": stablemax_cross_entropy(logits, labels).mean(),
    }


def test_eval_equals_the_trainers_evaluation(runs, evaluated):
    """Eval's means over the 12 puzzles (in batches of 8, the last padded) are, at the trained
    halt_max_steps (2), the trainer's evaluate_puzzles over all 12 at once, and at 1 and 3 the
    segments run one by one."""
    _, fns, step, params = Run.at(runs / "trm_s1").model()
    rows = sudoku.load(runs / "sudoku", "test").rows()

    def direct(params, rows):
        model = fns.module(params)
        return {1: segments(model, rows, 1), 2: evaluate_puzzles(model, rows), 3: segments(model, rows, 3)}

    expected = jax.jit(direct)(jax.device_get(params), rows)
    assert step == 2 and len(rows) == 12
    for halt, key in itertools.product((1, 2, 3), SCORES):
        got, want = evaluated[halt][f"test_{key}"], float(expected[halt][f"val_{key}"])
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=f"{key} at {halt}")


def test_seeds_are_pooled(runs, capsys, tmp_path):
    pooled_png = tmp_path / "pooled.png"
    args = ["--seeds", "0,1", "--halt-max-steps", "1,2,3", "--out", str(pooled_png)]
    assert main(["eval", str(runs / "trm_s{seed}"), *args]) == 0
    out = capsys.readouterr().out
    per_run = [evals(runs / f"trm_s{seed}") for seed in (0, 1)]
    assert [r[1]["step"] for r in per_run] == [1, 2] and pooled_png.is_file()
    assert per_run[0] != per_run[1]
    pooled = out[out.index("over 2 runs") :].splitlines()
    for halt in (1, 2, 3):
        line = next(line for line in pooled if re.match(rf"\s+{halt}[ *]", line))
        for key, fmt in (("cell_accuracy", "{:.2%}"), ("exact_accuracy", "{:.2%}"), ("act_steps", "{:.2f}")):
            values = [r[halt][f"test_{key}"] for r in per_run]
            stats = (np.mean(values), min(values), max(values))
            assert "{} [{}, {}]".format(*(fmt.format(v) for v in stats)) in line, (key, line)

    # trm_s1 at step 1 is trm_s0; without --halt-max-steps, the run's own value (2) is evaluated.
    assert main(["eval", str(runs / "trm_s1"), "--step", "1"]) == 0
    assert read_metrics(runs / "trm_s1")[-1] == pytest.approx(per_run[0][2], rel=1e-6)


def test_what_eval_refuses(runs, tmp_path, capsys):
    language = tmp_path / "llama"
    language.mkdir()
    save_config(load_config(None, SMALL), language / "config.yaml")
    for argv, message in (
        ([str(language)], "eval takes a run of a puzzle model (hrm, trm)"),
        ([str(tmp_path / "absent")], "not a run directory"),
        ([str(runs / "trm_s1"), "--seeds", "0,1"], "has none"),
        ([str(runs / "trm_s{seed}")], "give --seeds"),
        ([str(runs / "trm_s1"), "--halt-max-steps", "0,4"], "--halt-max-steps takes integers >= 1"),
        ([str(runs / "trm_s1"), "--step", "7"], "No checkpoint at step 7"),
    ):
        assert main(["eval", *argv]) == 2, argv
        assert message in capsys.readouterr().err, argv
