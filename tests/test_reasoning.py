"""Deep supervision with ACT for HRM and TRM: the loss, the carry between steps, sharding, resume, errors."""

import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import run_steps, trainer

from podtrain.cli import main
from podtrain.data import sudoku
from podtrain.train.metrics import read_metrics
from podtrain.train.reasoning import split, stablemax_cross_entropy

TINY = [
    "model.vocab_size=11", "model.max_seq_len=81", "train.seq_len=81", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=2",
    "model.d_ff=64", "model.compute_dtype=float32", "device_type=cpu", "train.batch_size=8", "train.lr=3e-3",
    "model.trm.H_cycles=2", "model.trm.L_cycles=1", "model.trm.puzzle_emb_len=4", "model.trm.halt_max_steps=2",
    "model.hrm.H_cycles=2", "model.hrm.L_cycles=1", "model.hrm.H_layers=1", "model.hrm.L_layers=1", "model.hrm.halt_max_steps=2",
]


@pytest.fixture(scope="module")
def puzzles(tmp_path_factory):
    out = tmp_path_factory.mktemp("sudoku")
    sudoku.build(out, "generate", n_train=16, n_test=8, givens=45, min_rating=0, copies=1, seed=0)
    return [*TINY, "data.source=sudoku", f"data.path={out}"]


def test_stablemax_cross_entropy():
    logits = jnp.array([[0.0, 1.0, -1.0]])  # s = 1, 2, 1/2
    np.testing.assert_allclose(stablemax_cross_entropy(logits, jnp.array([1])), [-np.log(2 / 3.5)], rtol=1e-6)
    grad = jax.grad(lambda x: stablemax_cross_entropy(x, jnp.array([0])).sum())(jnp.array([[1.0, 2.0, -3.0]]))
    assert np.isfinite(grad).all()  # also where the unused branch 1 / (1 - x) has a pole


@pytest.mark.parametrize("name", ["trm", "hrm"])
def test_halted_slots_take_new_puzzles_and_the_others_go_on(puzzles, name):
    state, step, batches = trainer([*puzzles, f"model.name={name}", "mesh.data=1", "model.trm.halt_exploration_prob=0", "model.hrm.halt_exploration_prob=0"], n_devices=1)
    state, metrics = step(state, batches[0])  # every slot starts halted: all take batch 0
    carry = jax.device_get(state["carry"])
    np.testing.assert_array_equal(carry["data"], np.asarray(batches[0]))
    np.testing.assert_array_equal(carry["steps"], 1)
    assert not carry["halted"].any()  # q_halt starts at -5 and step 1 < halt_max_steps
    assert ("q_continue_loss" in metrics) == (name == "hrm")  # HRM's bootstrapped continue target; TRM has none

    halted = np.arange(8) % 2 == 0
    state["carry"] = {**state["carry"], "halted": jax.device_put(halted[None], state["carry"]["halted"].sharding)}
    state, _ = step(state, batches[1])
    carry = jax.device_get(state["carry"])
    np.testing.assert_array_equal(carry["data"][0, halted], np.asarray(batches[1])[0, halted])
    np.testing.assert_array_equal(carry["data"][0, ~halted], np.asarray(batches[0])[0, ~halted])
    np.testing.assert_array_equal(carry["steps"][0], np.where(halted, 1, 2))
    np.testing.assert_array_equal(carry["halted"][0], ~halted)  # the continuing slots reached halt_max_steps


def test_metrics_of_halted_slots_are_pooled_over_microbatches(puzzles):
    """With grad_accum=2 and halts in one microbatch only, the metrics are those of that one, not NaN."""
    state, step, batches = trainer([*puzzles, "model.name=trm", "mesh.data=1", "train.grad_accum=2", "model.trm.halt_exploration_prob=0"], n_devices=1)
    state, metrics = step(state, batches[0])  # no slot halts at step 1 of halt_max_steps=2
    assert np.isnan(float(metrics["act_steps"]))
    restart = np.array([True] * 4 + [False] * 4).reshape(2, 4)  # microbatch 0 restarts, microbatch 1 reaches step 2 and halts
    state["carry"] = {**state["carry"], "halted": jax.device_put(restart, state["carry"]["halted"].sharding)}
    state, metrics = step(state, batches[1])
    assert float(metrics["act_steps"]) == 2.0 and 0 <= float(metrics["cell_accuracy"]) <= 1
    assert float(metrics["halted"]) == 0.5


@pytest.mark.parametrize("name,shape,extra", [("trm", (1, 4, 2), ["model.trm.mlp_t=true"]), ("trm", (2, 2, 2), []), ("hrm", (1, 2, 4), [])], ids=["trm-1x4x2-mlp_t", "trm-2x2x2", "hrm-1x2x4"])
def test_sharded_equals_unsharded(puzzles, name, shape, extra):
    common = [*puzzles, f"model.name={name}", *extra]
    ref_losses, ref_params = run_steps([*common, "mesh.data=1"], n_devices=1)
    losses, params = run_steps([*common, f"mesh.data={shape[0]}", f"mesh.fsdp={shape[1]}", f"mesh.tensor={shape[2]}"], n_devices=8)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-4), params, ref_params)


def test_resume_restores_the_carry(tmp_path, puzzles):
    """A TRM run resumed from its step-2 checkpoint logs the losses of an uninterrupted run. At step 2
    no slot has halted yet, so the run goes on only if the carry (latents, steps, puzzles) is restored."""

    def train(run):
        main(["train", *puzzles, "model.name=trm", "model.trm.halt_max_steps=3", f"run_dir={run}", "train.log_every=1", "checkpoint.every=2", "train.steps=4", "train.eval_every=100", "train.eval_batches=1"])
        return {r["step"]: r["loss"] for r in read_metrics(run) if "loss" in r}

    straight = train(tmp_path / "a")
    assert (tmp_path / "a" / "checkpoints" / "2" / "carry").is_dir()
    assert main(["generate", str(tmp_path / "a")]) == 2  # text sampling is for language models
    assert main(["plot", str(tmp_path / "a"), "--out", str(tmp_path / "a.png")]) == 0
    shutil.copytree(tmp_path / "a" / "checkpoints", tmp_path / "b" / "checkpoints")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "4")  # as if stopped before the step-4 save
    resumed = train(tmp_path / "b")
    assert sorted(resumed) == [3, 4]
    np.testing.assert_allclose([resumed[s] for s in (3, 4)], [straight[s] for s in (3, 4)], rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "name,overrides,margin",
    [
        ("trm", [], 0.2),
        ("hrm", ["model.name=hrm", "model.hrm.H_cycles=2", "model.hrm.L_cycles=2", "model.hrm.H_layers=1", "model.hrm.L_layers=1", "model.hrm.halt_max_steps=2"], 0.03),
    ],
)
def test_short_cpu_run_beats_copying_the_givens(tmp_path_factory, name, overrides, margin):
    """configs/trm_sudoku_tiny.yaml, and HRM at that size: 150 steps on easy generated puzzles (45
    givens) lift held-out cell accuracy above copying the givens and guessing the blanks
    (55.6% + 44.4% / 9 = 60.5%): TRM (mlp_t) to about 85%, HRM to about 66%."""
    data = tmp_path_factory.getbasetemp() / "sudoku-easy"
    if not data.exists():
        sudoku.build(data, "generate", n_train=250, n_test=128, givens=45, min_rating=0, copies=7, seed=0)  # as the recipe says
    run = tmp_path_factory.mktemp(name)
    recipe = str(Path(__file__).parent.parent / "configs" / "trm_sudoku_tiny.yaml")
    assert main(["train", recipe, *overrides, "train.eval_every=150", "device_type=cpu", f"data.path={data}", f"run_dir={run}"]) == 0
    baseline = sudoku.load(data, "test").copy_baseline()
    final = [r for r in read_metrics(run) if "val_cell_accuracy" in r][-1]
    print(f"{name}: held-out cell accuracy {final['val_cell_accuracy']:.3f}, exact {final['val_exact_accuracy']:.3f}, copy-the-givens {baseline:.3f}")
    assert final["val_cell_accuracy"] > baseline + (1 - baseline) / 9 + margin


def test_split_reads_the_rows(puzzles):
    test = sudoku.load(puzzles[-1].split("=", 1)[1], "test")
    ids, inputs, labels = split(test.rows())
    assert (ids == 0).all()
    np.testing.assert_array_equal(inputs, test.inputs)
    np.testing.assert_array_equal(labels, test.labels)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["model.name=trm"], "data.source=sudoku"),
        (["model.name=llama", "data.source=sudoku", "data.path=x"], "not text"),
        (["model.name=trm", "data.source=sudoku", "data.path=/nonexistent", "model.max_seq_len=81", "train.seq_len=81", "model.vocab_size=11"], "podtrain data sudoku --out"),
        (["model.name=trm", "data.source=sudoku", "data.path=x", "train.seq_len=64", "model.max_seq_len=64"], "model.max_seq_len=81"),
        (["model.name=trm", "model.trm.halt_max_steps=0"], "at least 1"),
    ],
)
def test_mismatched_model_and_data_are_clear_errors(tmp_path, capsys, overrides, message):
    assert main(["train", "device_type=cpu", f"run_dir={tmp_path}", *overrides]) == 2
    assert message in capsys.readouterr().err
