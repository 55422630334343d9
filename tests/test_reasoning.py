"""Deep supervision with ACT for HRM and TRM: the loss, the carry between steps, sharding, resume, errors."""

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from podtrain.cli import main
from podtrain.data import sudoku
from podtrain.program.job import build
from podtrain.program.load import load_config
from podtrain.program.tasks.puzzles import CELLS, act_loss, split, stablemax_cross_entropy
from podtrain.runtime.mesh import build_mesh
from podtrain.train.metrics import read_metrics

from helpers import RECURSION, TINY, run_steps, trainer


@pytest.fixture(scope="module")
def puzzles(tmp_path_factory):
    out = tmp_path_factory.mktemp("sudoku")
    sudoku.build(out, "generate", n_train=16, n_test=8, givens=45, min_rating=0, copies=1, seed=0)
    return [*TINY, "data.source=sudoku", f"data.path={out}"]


def test_stablemax_cross_entropy():
    logits = jnp.array([[0.0, 1.0, -1.0]])  # s = 1, 2, 1/2
    np.testing.assert_allclose(stablemax_cross_entropy(logits, jnp.array([1])), [-np.log(2 / 3.5)], rtol=1e-6)
    # x = (1, 2, -3): s = (2, 3, 1/4), S = 5.25, and s' = 1 for x >= 0, 1 / (1 - x)^2 below. The gradient
    # of -log s(x_0) + log S is s'(x_j) / S - [j = 0] s'(x_0) / s(x_0); finite also where the unused
    # branch 1 / (1 - x) has a pole (x = 1).
    x = jnp.array([[1.0, 2.0, -3.0]])
    grad = jax.grad(lambda x: stablemax_cross_entropy(x, jnp.array([0])).sum())(x)
    np.testing.assert_allclose(grad, [[1 / 5.25 - 1 / 2, 1 / 5.25, 1 / 16 / 5.25]], rtol=1e-6)

    def reference(x, label):  # float64, in numpy
        s = np.where(x >= 0, x + 1, 1 / (1 - np.minimum(x, 0)))
        return -np.log(s[label] / s.sum())

    y = np.array([0.7, -0.4, 1.9, -2.2, 0.1])  # both branches, away from the kink at 0
    grad = np.asarray(jax.grad(lambda x: stablemax_cross_entropy(x, jnp.array(3)))(jnp.asarray(y, jnp.float32)))
    h = 1e-6
    central = [(reference(y + h * e, 3) - reference(y - h * e, 3)) / (2 * h) for e in np.eye(len(y))]
    np.testing.assert_allclose(
        stablemax_cross_entropy(jnp.asarray(y, jnp.float32), jnp.array(3)), reference(y, 3), rtol=1e-6
    )
    np.testing.assert_allclose(grad, central, rtol=1e-5, atol=1e-7)


class StandIn:
    """A model for act_loss whose outputs the test sets: its logits, and its Q logits call by call
    (HRM calls twice: the segment, then the next one for the continue target; the last entry
    repeats). It records what it is called with (see run_act) and returns the latents plus one."""

    def __init__(self, cfg, qs, logits=None):
        self.cfg, self.qs, self.logits, self.calls = cfg, qs, logits, []

    def initial_carry(self, batch):
        return jnp.full((batch, 2, 3), -1.0), jnp.full((batch, 2, 3), -2.0)

    def __call__(self, carry, tokens, puzzle_ids):
        self.calls.append((carry, tokens, puzzle_ids))
        q = jnp.asarray(self.qs[min(len(self.calls), len(self.qs)) - 1], jnp.float32)
        logits = jnp.zeros((len(tokens), CELLS, sudoku.VOCAB)) if self.logits is None else self.logits
        return jax.tree.map(lambda z: z + 1, carry), logits, q


def run_act(model, carry, rows, key):
    """act_loss jitted, as the train step runs it (eagerly its many small ops would each compile),
    and the inputs of each of the model's calls."""
    return jax.jit(lambda *args: (act_loss(model, *args), model.calls))(carry, rows, key)


def act_config(name, **changes):
    return dataclasses.replace(
        load_config(None, [f"model.name={name}"]).model, **{"halt_exploration_prob": 0.0, **changes}
    )


def puzzle_rows(n, seed):
    """n rows [puzzle id, 81 inputs, 81 labels], ids and tokens distinct from another seed's."""
    rng = np.random.default_rng(seed)
    ids = 100 * seed + np.arange(n)[:, None]
    return jnp.asarray(
        np.concatenate([ids, rng.integers(0, 11, (n, CELLS)), rng.integers(1, 11, (n, CELLS))], axis=1), jnp.int32
    )


def act_carry(data, steps, halted):
    """A carry whose latents tell the slots apart: slot i holds i in z_H and 100 + i in z_L."""
    z = jnp.broadcast_to(jnp.arange(len(data), dtype=jnp.float32)[:, None, None], (len(data), 2, 3))
    return {
        "z_h": z,
        "z_l": z + 100,
        "steps": jnp.asarray(steps, jnp.int32),
        "halted": jnp.broadcast_to(jnp.asarray(halted), (len(data),)),
        "data": data,
    }


def bce(logit, target):
    p = 1 / (1 + np.exp(-np.asarray(logit)))
    return -np.mean(target * np.log(p) + (1 - target) * np.log(1 - p))


@pytest.mark.parametrize("name,halts", [("trm", [1, 0, 1, 0, 0, 1]), ("hrm", [0, 1, 1, 1, 0, 1])])
def test_q_head_halts_a_slot_before_the_last_step(name, halts):
    """TRM halts a slot when q_halt > 0, HRM when q_halt > q_continue (q = (1, 2), (-1, -2) and (0, -1)
    tell the rules apart); the last slot reaches halt_max_steps and halts whatever its Q head says.
    act_steps sums the steps of the halted slots only."""
    q = [[1.0, 2.0], [-1.0, -2.0], [1.0, 0.0], [0.0, -1.0], [-1.0, 0.0], [-1.0, 0.0]]
    model = StandIn(act_config(name, halt_max_steps=4), [q])
    (_, (carry, metrics)), _ = run_act(
        model, act_carry(puzzle_rows(6, 0), [1, 1, 1, 1, 1, 3], False), puzzle_rows(6, 1), jax.random.key(0)
    )
    np.testing.assert_array_equal(carry["steps"], [2, 2, 2, 2, 2, 4])
    np.testing.assert_array_equal(carry["halted"], np.array(halts, bool))
    halted_steps = np.array([2, 2, 2, 2, 2, 4])[np.array(halts, bool)]
    assert (float(metrics["act_steps"][0]), int(metrics["act_steps"][1])) == (halted_steps.sum(), len(halted_steps))


@pytest.mark.parametrize("prob", [0.5, 1.0])
def test_exploration_delays_halting_to_a_drawn_step(prob):
    """With probability halt_exploration_prob a slot whose Q head says halt goes on to a minimum step
    drawn from [2, halt_max_steps]: the draw is reproduced from the key as act_loss splits it, and
    the share that halts is about what that draw implies over steps 1..8 ((1 - prob) + prob / 2)."""
    n, last, key = 512, 8, jax.random.key(3)
    model = StandIn(
        act_config("trm", halt_max_steps=last, halt_exploration_prob=prob), [jnp.tile(jnp.array([5.0, -5.0]), (n, 1))]
    )
    (_, (carry, _)), _ = run_act(
        model, act_carry(puzzle_rows(n, 0), np.arange(n) % last, False), puzzle_rows(n, 1), key
    )
    steps, halted = np.asarray(carry["steps"]), np.asarray(carry["halted"])
    explore, draw = jax.random.split(key)
    min_steps = jnp.where(jax.random.bernoulli(explore, prob, (n,)), jax.random.randint(draw, (n,), 2, last + 1), 0)
    np.testing.assert_array_equal(halted, steps >= min_steps)
    assert halted[steps == last].all() and (prob < 1 or not halted[steps == 1].any())
    assert abs(halted.mean() - (1 - prob / 2)) < 0.1


def test_q_continue_learns_the_next_segments_q():
    """HRM's q_continue learns sigmoid(max Q) of the next segment, run from this segment's latents,
    or sigmoid(next q_halt) at the last step; the carry keeps this segment's latents."""
    q = [[0.0, 1.0], [0.0, -2.0], [0.0, 0.5]]
    next_q = [[3.0, -1.0], [-1.0, 2.0], [-1.0, 2.0]]  # the last slot's larger logit is q_continue, but it is at step 4
    model = StandIn(act_config("hrm", halt_max_steps=4), [q, next_q])
    state = act_carry(puzzle_rows(3, 0), [1, 1, 3], False)
    (_, (carry, metrics)), calls = run_act(model, state, puzzle_rows(3, 1), jax.random.key(0))
    target = 1 / (1 + np.exp(-np.array([3.0, 2.0, -1.0])))
    np.testing.assert_allclose(metrics["q_continue_loss"], bce([1.0, -2.0, 0.5], target), rtol=1e-5)
    (first, tokens, ids), (second, next_tokens, next_ids) = calls
    for z, z_next, z_out in zip(first, second, (carry["z_h"], carry["z_l"])):
        np.testing.assert_array_equal(z_next, z + 1)
        np.testing.assert_array_equal(z_out, z + 1)
    np.testing.assert_array_equal(next_tokens, tokens)
    np.testing.assert_array_equal(next_ids, ids)


def test_halted_slots_restart_from_the_initial_latents():
    """Slots that halted at the previous step start their new row's puzzle from the model's initial
    latents at step 1; the others go on from their own latents and puzzle at their next step."""
    halted = np.array([True, False, True, False])
    old, new = puzzle_rows(4, 0), puzzle_rows(4, 1)
    state = act_carry(old, [3, 1, 16, 2], halted)
    model = StandIn(act_config("trm", halt_max_steps=16), [jnp.full((4, 2), -5.0)])
    (_, (carry, _)), calls = run_act(model, state, new, jax.random.key(0))
    (z_h, z_l), tokens, ids = calls[0]
    for z, z0, kept in zip((z_h, z_l), model.initial_carry(4), (state["z_h"], state["z_l"])):
        np.testing.assert_array_equal(z, np.where(halted[:, None, None], z0, kept))
    data = np.where(halted[:, None], new, old)
    np.testing.assert_array_equal(carry["data"], data)
    np.testing.assert_array_equal(tokens, data[:, 1 : 1 + CELLS])
    np.testing.assert_array_equal(ids, data[:, 0])
    np.testing.assert_array_equal(carry["steps"], [1, 2, 1, 3])
    np.testing.assert_array_equal(carry["z_h"], z_h + 1)  # the model's latents, carried to the next step


def test_q_halt_learns_whether_the_puzzle_is_exactly_right():
    """q_halt's target is 1 only where every cell is right (slot 1 misses one cell), and the loss
    is lm + q_halt / 2 for TRM. Accuracies are over the slots that halted (q_halt > 0: slots 0, 1)."""
    rows = puzzle_rows(4, 0)
    labels = np.asarray(split(rows)[2])
    guess = labels.copy()
    guess[1, 0] = guess[1, 0] % 10 + 1
    guess[2] = guess[2] % 10 + 1
    logits = 5 * jax.nn.one_hot(guess, sudoku.VOCAB)
    q_halt = np.array([2.0, 1.0, -1.0, -3.0])
    model = StandIn(act_config("trm"), [np.stack([q_halt, np.zeros(4)], -1)], logits)
    (loss, (_, metrics)), _ = run_act(model, act_carry(rows, 0, True), rows, jax.random.key(0))
    np.testing.assert_allclose(metrics["q_halt_loss"], bce(q_halt, np.array([1, 0, 0, 1])), rtol=1e-5)
    lm = stablemax_cross_entropy(logits, labels).mean()
    np.testing.assert_allclose(metrics["lm_loss"], lm, rtol=1e-6)
    np.testing.assert_allclose(loss, lm + 0.5 * metrics["q_halt_loss"], rtol=1e-6)
    assert "q_continue_loss" not in metrics
    np.testing.assert_allclose(metrics["exact_accuracy"], (1, 2))
    np.testing.assert_allclose(metrics["cell_accuracy"], (1 + 80 / 81, 2), rtol=1e-6)


@pytest.mark.parametrize("name", ["trm", "hrm"])
def test_halted_slots_take_new_puzzles_and_the_others_go_on(puzzles, name):
    state, step, batches = trainer(
        [*puzzles, *RECURSION[name], "mesh.data=1", "model.halt_exploration_prob=0"], n_devices=1
    )
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
    """With grad_accum=2, the accuracies and ACT steps are over the slots that halted in either
    microbatch, each slot counted once: with halts in one microbatch only they are that one's (not
    NaN); with 1 and 3 halts, the mean over those 4 slots (not the mean of the two microbatches'
    means). The labels of the continuing puzzles are set so that the model's own prediction (its
    forward pass run here on the slots' latents) is right in the first k cells of slot i only."""
    cfg = load_config(
        None, [*puzzles, *RECURSION["trm"], "mesh.data=1", "train.grad_accum=2", "model.halt_exploration_prob=0"]
    )
    job = build(cfg, build_mesh(cfg.mesh, jax.devices()[:1]))
    state, batches = job.init_state(cfg.seed), job.task.batches
    state, metrics = job.step(state, batches[0])  # no slot halts at step 1 of halt_max_steps=2
    assert np.isnan(float(metrics["act_steps"])) and np.isnan(float(metrics["cell_accuracy"]))
    after_one, shardings = jax.device_get(state), jax.tree.map(lambda x: x.sharding, state)
    forward = jax.jit(lambda params, z, rows: job.setup.fns.module(params)(z, split(rows)[1], split(rows)[0])[1])
    carry = after_one["carry"]
    predicted = np.stack(
        [forward(after_one["params"], (carry["z_h"][i], carry["z_l"][i]), carry["data"][i]) for i in range(2)]
    ).argmax(-1)  # (microbatch, slot, cell)
    k = np.array([[0, 0, 0, 81], [0, 27, 54, 81]])  # right cells per slot
    carry["data"] = np.array(carry["data"])
    carry["data"][..., 1 + CELLS :] = np.where(
        np.arange(CELLS) < k[..., None], predicted, (predicted + 1) % sudoku.VOCAB
    )

    for restart, cell, exact in (
        ([[True] * 4, [False] * 4], 0.5, 0.25),  # mb 1 halts: (0 + 1/3 + 2/3 + 1) / 4, 1 of 4 exact
        ([[True, True, True, False], [True, False, False, False]], 0.75, 0.5),  # (1 + 1/3 + 2/3 + 1) / 4, 2 of 4
    ):
        restart = np.array(restart)  # a restarted slot is at step 1; the others reach step 2 and halt
        state = jax.device_put(after_one, shardings)
        state["carry"]["halted"] = jax.device_put(restart, shardings["carry"]["halted"])
        _, metrics = job.step(state, batches[1])
        assert float(metrics["act_steps"]) == 2.0
        np.testing.assert_allclose(float(metrics["cell_accuracy"]), cell, rtol=1e-6)
        np.testing.assert_allclose(float(metrics["exact_accuracy"]), exact, rtol=1e-6)
        np.testing.assert_allclose(float(metrics["halted"]), (~restart).mean(), rtol=1e-6)


@pytest.mark.parametrize(
    "name,shape,extra",
    [("trm", (1, 4, 2), ["model.mlp_t=true"]), ("trm", (2, 2, 2), []), ("hrm", (1, 2, 4), [])],
    ids=["trm-1x4x2-mlp_t", "trm-2x2x2", "hrm-1x2x4"],
)
def test_sharded_equals_unsharded(puzzles, name, shape, extra):
    common = [*puzzles, *RECURSION[name], *extra]
    ref_losses, ref_params = run_steps([*common, "mesh.data=1"], n_devices=1)
    losses, params = run_steps(
        [*common, f"mesh.data={shape[0]}", f"mesh.fsdp={shape[1]}", f"mesh.tensor={shape[2]}"], n_devices=8
    )
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-4), params, ref_params)


def test_resume_restores_the_carry(tmp_path, puzzles):
    """A TRM run resumed from its step-2 checkpoint logs the losses of an uninterrupted run. At step 2
    no slot has halted yet, so the run goes on only if the carry (latents, steps, puzzles) is restored."""

    def train(run):
        main(
            [
                "train",
                *puzzles,
                *RECURSION["trm"],
                "model.halt_max_steps=3",
                f"run_dir={run}",
                "train.log_every=1",
                "checkpoint.every=2",
                "train.steps=4",
                "train.eval_every=100",
                "train.eval_batches=1",
            ]
        )
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


@pytest.mark.integration
@pytest.mark.parametrize("name,margin", [("trm", 0.1), ("hrm", 0.03)])
def test_short_cpu_run_beats_copying_the_givens(tmp_path_factory, name, margin):
    """configs/trm_sudoku_tiny.yaml and hrm_sudoku_tiny.yaml: 100 of their 150 steps on easy
    generated puzzles (45 givens) lift held-out cell accuracy above copying the givens and guessing
    the blanks (55.6% + 44.4% / 9 = 60.5%): TRM (mlp_t) to about 75% (89% after 150), HRM to about
    66% (67%)."""
    data = tmp_path_factory.getbasetemp() / "sudoku-easy"
    if not data.exists():
        sudoku.build(
            data, "generate", n_train=250, n_test=128, givens=45, min_rating=0, copies=7, seed=0
        )  # as the recipe says
    run = tmp_path_factory.mktemp(name)
    recipe = str(Path(__file__).parent.parent / "configs" / f"{name}_sudoku_tiny.yaml")
    # As a user runs it: one CPU device, compiled optimised (150 steps run twice as fast as the
    # tests' unoptimised compiles).
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "podtrain",
            "train",
            recipe,
            "train.steps=100",
            "train.eval_every=100",
            f"data.path={data}",
            f"run_dir={run}",
        ],
        env={**os.environ, "XLA_FLAGS": ""},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    baseline = sudoku.load(data, "test").copy_baseline()
    final = [r for r in read_metrics(run) if "val_cell_accuracy" in r][-1]
    print(
        f"{name}: held-out cell accuracy {final['val_cell_accuracy']:.3f}, "
        f"exact {final['val_exact_accuracy']:.3f}, copy-the-givens {baseline:.3f}"
    )
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
        (["model.name=llama", "data.source=sudoku", "data.path=x"], "model.name=llama reads data.source=pydoc"),
        (["model.name=trm", "data.source=sudoku", "data.path=/nonexistent"], "podtrain data sudoku --out"),
        (["model.name=trm", "data.source=sudoku", "data.path=x", "model.max_seq_len=64"], "model.max_seq_len=81"),
        (["model.name=trm", "train.seq_len=81"], "Unknown config key `train.seq_len` for model.name=trm"),
        (["model.name=hrm", "model.n_layers=2"], "Did you mean `model.L_layers`?"),
        (["model.name=hrm", "model.mlp_t=true"], "Unknown config key `model.mlp_t`"),
        (["model.name=trm", "model.halt_max_steps=0"], "valid values: >= 1"),
    ],
)
def test_mismatched_model_and_data_are_clear_errors(tmp_path, capsys, overrides, message):
    assert main(["train", "device_type=cpu", f"run_dir={tmp_path}", *overrides]) == 2
    assert message in capsys.readouterr().err
