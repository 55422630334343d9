"""The optimizer: the learning-rate schedule, clipping, and which parameters weight decay reaches."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from podtrain.config.parallel import MeshConfig
from podtrain.data import sudoku
from podtrain.errors import ConfigError
from podtrain.program import optim
from podtrain.program.job import build
from podtrain.program.load import load_config
from podtrain.program.state import decay_mask, init_state, train_setup
from podtrain.runtime.mesh import build_mesh

from helpers import LANGUAGE_FAMILIES

VECTORS = {"scale", "alpha", "bias"}  # norms' scales and mHC's gates and biases: never decayed


def test_warmup_trains_from_the_first_step():
    t = load_config(None, ["train.steps=100", "train.warmup_steps=10", "train.lr=1e-3", "train.min_lr_ratio=0.1"]).train
    lr = optim.schedule(t)
    np.testing.assert_allclose([lr(0), lr(9), lr(99)], [1e-4, 1e-3, 1e-4], rtol=1e-5)
    assert optim.warmup_note(t) is None
    long = load_config(None, ["train.steps=5", "train.warmup_steps=10", "train.lr=1e-3"]).train
    np.testing.assert_allclose([optim.schedule(long)(0), optim.schedule(long)(4)], [1e-4, 5e-4], rtol=1e-5)
    assert "50% of train.lr" in optim.warmup_note(long)


def test_schedule_is_linear_then_cosine():
    """Warmup climbs by lr / warmup_steps a step up to lr at step warmup_steps - 1; the cosine then
    falls every step, passes halfway between lr and its floor midway, and ends on the floor."""
    t = load_config(None, ["train.steps=100", "train.warmup_steps=10", "train.lr=1e-3", "train.min_lr_ratio=0.1"]).train
    lr = np.array([optim.schedule(t)(s) for s in range(t.steps)])
    np.testing.assert_allclose(lr[:10], 1e-4 * np.arange(1, 11), rtol=1e-5)
    assert (np.diff(lr[9:]) < 0).all()
    np.testing.assert_allclose(
        [lr[54], lr[99]], [1e-3 * (1 + 0.1) / 2, 1e-4], rtol=1e-5
    )  # 45 of the 90 decay steps at step 54


def test_min_lr_ratio_one_holds_the_rate_after_warmup():
    """With its floor at lr the cosine is flat: lr from the end of warmup to the last step."""
    t = load_config(None, ["train.steps=50", "train.warmup_steps=5", "train.lr=1e-3", "train.min_lr_ratio=1"]).train
    np.testing.assert_allclose([optim.schedule(t)(s) for s in range(4, 50)], 1e-3, rtol=1e-6)


def test_adamw_moves_by_the_scheduled_rate():
    """Under a constant gradient Adam's bias-corrected step is sign(g), so without weight decay the
    optimizer moves each weight by the schedule's rate of that step, counted from step 0."""
    t = load_config(
        None, ["train.steps=8", "train.warmup_steps=3", "train.lr=0.1", "train.weight_decay=0", "train.grad_clip=0"]
    ).train
    tx = optim.optimizer(t, {"w": True})
    params, grads = {"w": jnp.zeros(3)}, {"w": jnp.array([2.0, -0.5, 1.0])}
    update, opt, moves = jax.jit(tx.update), tx.init(params), []
    for _ in range(t.steps):
        updates, opt = update(grads, opt, params)
        params = optax.apply_updates(params, updates)
        moves.append(updates["w"])
    expected = [-np.sign(grads["w"]) * optim.schedule(t)(s) for s in range(t.steps)]
    np.testing.assert_allclose(moves, expected, rtol=1e-5)


@pytest.mark.parametrize("clip,norm", [(0, 5.0), (1.0, 1.0)])
def test_grad_clip_zero_turns_clipping_off(clip, norm):
    tx = optim.clipping(load_config(None, [f"train.grad_clip={clip}"]).train)
    grads = {"w": jnp.array([3.0, 4.0])}
    clipped, _ = tx.update(grads, tx.init(grads))
    np.testing.assert_allclose(optax.tree.norm(clipped), norm, rtol=1e-6)


@pytest.mark.parametrize("name", LANGUAGE_FAMILIES)
def test_weight_decay_reaches_matrices_only(small_overrides, name):
    """The mask decays the matrices (embedding, projections, mHC's phi) and spares the vectors, also
    when stacked on `layers`, which is no matrix axis. One step of the train setup's optimizer with
    zero gradients then shrinks each decayed weight by lr x weight_decay x its value and leaves the
    others exactly as they were."""
    cfg = load_config(None, [*small_overrides, f"model.name={name}", "train.lr=0.1", "train.weight_decay=0.5"])
    setup = train_setup(cfg, build_mesh(MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1]))
    mask = decay_mask(setup.fns.logical_axes)
    assert mask == jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key not in VECTORS, mask)
    assert mask["layers"]["attn"]["wq"] and not mask["layers"]["attn_norm"]["scale"] and not mask["norm"]["scale"]

    state = init_state(setup, seed=0)
    zeros = jax.tree.map(jnp.zeros_like, state["params"])
    updates, _ = jax.jit(setup.tx.update)(zeros, state["opt"], state["params"])
    new = optax.apply_updates(state["params"], updates)
    shrink = 1 - optim.schedule(cfg.train)(0) * 0.5

    def check(decayed, before, after):
        if decayed:
            np.testing.assert_allclose(after, before * shrink, rtol=1e-6)
        else:
            np.testing.assert_array_equal(after, before)

    jax.tree.map(check, mask, state["params"], new)


def test_adam_atan2_follows_its_definition():
    """Three steps on a hand-made case against AdamATan2 written out in numpy as HRM and TRM's
    optimizer defines it: p <- p (1 - lr wd); m <- b1 m + (1 - b1) g; v <- b2 v + (1 - b2) g^2;
    p <- p - lr atan2(m / (1 - b1^t), sqrt(v / (1 - b2^t)))."""
    t = load_config(
        None,
        [
            "train.optimizer=adam_atan2",
            "train.steps=10",
            "train.warmup_steps=2",
            "train.lr=0.05",
            "train.weight_decay=0.3",
            "train.beta1=0.8",
            "train.beta2=0.9",
            "train.grad_clip=0",
        ],
    ).train
    tx = optim.optimizer(t, {"w": True, "b": False})
    params = {"w": jnp.array([[0.5, -1.0], [2.0, 0.0]]), "b": jnp.array([0.3, -0.2])}
    grads = [
        {"w": jnp.array([[0.1, -2.0], [0.0, 3.0]]), "b": jnp.array([1e-8, -1.0])},
        {"w": jnp.array([[-0.4, 1.0], [0.2, 0.0]]), "b": jnp.array([0.5, 0.0])},
        {"w": jnp.array([[0.3, 0.3], [-5.0, 1e-3]]), "b": jnp.array([-2.0, 4.0])},
    ]
    expected = {k: np.asarray(v, np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in expected.items()}
    v = {k: np.zeros_like(x) for k, x in expected.items()}
    opt = tx.init(params)
    for step, g in enumerate(grads):
        updates, opt = tx.update(g, opt, params)
        params = optax.apply_updates(params, updates)
        lr, n = float(optim.schedule(t)(step)), step + 1
        for k in expected:
            gk = np.asarray(g[k], np.float64)
            expected[k] *= 1 - lr * (0.3 if k == "w" else 0.0)
            m[k] = 0.8 * m[k] + 0.2 * gk
            v[k] = 0.9 * v[k] + 0.1 * gk**2
            expected[k] -= lr * np.arctan2(m[k] / (1 - 0.8**n), np.sqrt(v[k] / (1 - 0.9**n)))
        for k in expected:
            np.testing.assert_allclose(params[k], expected[k], rtol=1e-6, atol=1e-7)


def test_sign_sgd_moves_the_reached_rows_of_the_puzzle_embedding():
    """Sign-SGD with decoupled decay on the rows the gradient reaches, p <- p (1 - lr wd) - lr sign(g),
    at its own rate on the main schedule; a row without gradient stays; the rest goes to the main
    optimizer."""
    t = load_config(
        None, ["train.steps=4", "train.warmup_steps=2", "train.lr=0.1", "train.puzzle_emb_lr=0.01", "train.grad_clip=0"]
    ).train
    t.puzzle_emb_weight_decay = 0.5
    tx = optim.optimizer(t, {"w": True, "puzzle_emb": True})
    params = {"w": jnp.ones(2), "puzzle_emb": jnp.array([[1.0, -2.0], [3.0, 4.0], [0.5, 0.0]])}
    grads = {"w": jnp.array([1.0, -1.0]), "puzzle_emb": jnp.array([[0.2, -7.0], [0.0, 0.0], [0.0, 1e-9]])}
    opt = tx.init(params)
    for step in range(2):
        p = np.asarray(params["puzzle_emb"], np.float64)
        updates, opt = tx.update(grads, opt, params)
        params = optax.apply_updates(params, updates)
        lr = 0.01 * (step + 1) / 2  # the warmup of train.lr, scaled to puzzle_emb_lr
        expected = p * (1 - lr * 0.5) - lr * np.sign(np.asarray(grads["puzzle_emb"]))
        expected[1] = p[1]
        np.testing.assert_allclose(params["puzzle_emb"], expected, rtol=1e-6)
    adamw, w = optim.main_optimizer(t, {"w": True}), {"w": jnp.ones(2)}
    opt = adamw.init(w)
    for _ in range(2):
        updates, opt = adamw.update({"w": grads["w"]}, opt, w)
        w = optax.apply_updates(w, updates)
    np.testing.assert_array_equal(params["w"], w["w"])


def test_a_model_without_puzzle_embedding_refuses_its_rate():
    t = load_config(None, ["train.puzzle_emb_lr=0.01"]).train
    with pytest.raises(ConfigError, match="train.puzzle_emb_lr"):
        optim.optimizer(t, {"w": True})


def test_reference_optimizers_through_a_train_step(tmp_path):
    """One real step of TRM with AdamATan2 and sign-SGD: on the first step Adam's moments are g and
    g^2, so every weight with a gradient moves by lr (pi/4 sign(g) + wd p) (decay on matrices), and
    the zero-initialised puzzle embedding by exactly puzzle_emb_lr x sign(g)."""
    out = tmp_path / "sudoku"
    sudoku.build(out, "generate", n_train=8, n_test=8, givens=45, min_rating=0, copies=1, seed=0)
    overrides = [
        "model.name=trm",
        "model.d_model=16",
        "model.n_heads=2",
        "model.d_ff=32",
        "model.H_cycles=1",
        "model.L_cycles=1",
        "model.L_layers=1",
        "model.puzzle_emb_len=2",
        "model.halt_max_steps=2",
        "model.compute_dtype=float32",
        "device_type=cpu",
        "train.batch_size=8",
        "train.optimizer=adam_atan2",
        "train.lr=1e-2",
        "train.weight_decay=0.5",
        "train.puzzle_emb_lr=1e-3",
        "train.grad_clip=0",
        "data.source=sudoku",
        f"data.path={out}",
    ]
    cfg = load_config(None, overrides)
    job = build(cfg, build_mesh(cfg.mesh, jax.devices()[:1]))
    state, mask = job.init_state(cfg.seed), decay_mask(job.setup.fns.logical_axes)
    before = jax.tree.map(np.asarray, state["params"])
    after, _ = job.step(state, job.task.batches[0])
    after = jax.tree.map(np.asarray, after["params"])
    lr, emb_lr = 1e-2 / 20, 1e-3 / 20  # step 0 of a 20-step warmup

    moved = np.abs(after["puzzle_emb"] - before["puzzle_emb"])
    assert before["puzzle_emb"].max() == 0 and (moved > 0).all()
    np.testing.assert_allclose(moved, emb_lr, rtol=1e-5)

    def check(decayed, p0, p1):  # a weight without gradient only decays
        step_size = np.abs((p0 - p1) / lr - (0.5 * p0 if decayed else 0))
        at_pi_4 = np.isclose(step_size, np.pi / 4, atol=1e-3)
        assert at_pi_4.any() and (at_pi_4 | (step_size < 1e-3)).all()  # 1e-3: float32 rounding

    rest = {k: v for k, v in mask.items() if k != "puzzle_emb"}
    jax.tree.map(check, rest, {k: before[k] for k in rest}, {k: after[k] for k in rest})
