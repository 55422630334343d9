"""The optimizer: the learning-rate schedule, clipping, and which parameters weight decay reaches."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from podtrain.config.load import load_config
from podtrain.config.schema import MeshConfig
from podtrain.runtime.mesh import build_mesh
from podtrain.train import optim
from podtrain.train.state import decay_mask, init_state, train_setup

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


@pytest.mark.parametrize("name", ["llama", "mhc"])
def test_weight_decay_reaches_matrices_only(small_overrides, name):
    """The mask decays the matrices (embedding, projections, mHC's phi) and spares the vectors, also
    when stacked on `layers`, which is no matrix axis. One step of the train setup's optimizer with
    zero gradients then shrinks each decayed weight by lr x weight_decay x its value and leaves the
    others exactly as they were."""
    cfg = load_config(None, [*small_overrides, f"model.name={name}", "train.lr=0.1", "train.weight_decay=0.5"])
    setup = train_setup(cfg, build_mesh(MeshConfig(1, 1, 1), jax.devices()[:1]))
    mask = decay_mask(setup.fns)
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
