"""HRM and TRM: the references' parameter counts, and gradients only through the last cycle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from podtrain.models.layers import SwiGLU, rms_norm, rms_norm_keeping_input
from podtrain.models.recursive import HRM, TRM
from podtrain.models.rope import rope_tables
from podtrain.program.load import load_config

PAPER = ["model.d_model=512", "model.n_heads=8", "model.d_ff=1536", "model.compute_dtype=float32"]
SMALL = ["model.d_model=32", "model.n_heads=2", "model.d_ff=64", "model.compute_dtype=float32"]
NAMES = {HRM: "hrm", TRM: "trm"}


@pytest.mark.parametrize(
    "cls,extra,reference",
    [(HRM, [], 27_275_266), (TRM, [], 6_828_034), (TRM, ["model.mlp_t=true"], 5_028_866)],
    ids=["hrm", "trm", "trm-mlp_t"],
)
def test_parameter_counts_match_the_references(cls, extra, reference):
    cfg = load_config(None, [f"model.name={NAMES[cls]}", *PAPER, *extra])
    params = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: cls(cfg.model, rngs=nnx.Rngs(0)))))
    n = sum(x.size for x in jax.tree.leaves(params)) - params["puzzle_emb"].size  # the references count it apart
    assert n == reference


def build(cls, extra):
    cfg = load_config(None, [f"model.name={NAMES[cls]}", *SMALL, *extra])
    model = cls(cfg.model, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    tokens = jax.random.randint(jax.random.key(1), (2, 81), 1, 11)
    return model, graphdef, params, tokens


def loss(graphdef, params, carry, tokens):
    _, logits, q = nnx.merge(graphdef, params)(carry, tokens, jnp.zeros(len(tokens), jnp.int32))
    weights = jax.random.normal(jax.random.key(2), logits.shape)
    return (logits * weights).sum() + q.sum()


def grad_all(graphdef, params, carry, tokens):
    """Gradients with respect to the params and the starting carry."""
    return jax.jit(jax.grad(lambda p, c: loss(graphdef, p, c, tokens), argnums=(0, 1)))(params, carry)


def grad_params(graphdef, params, carry, tokens):
    return grad_all(graphdef, params, carry, tokens)[0]


@pytest.mark.parametrize("mlp_t", [False, True])
def test_trm_segment_shapes_and_q_init(mlp_t):
    model, _, _, tokens = build(TRM, [f"model.mlp_t={mlp_t}"])
    carry, logits, q = nnx.jit(lambda m, c, t: m(c, t, jnp.zeros(2, jnp.int32)))(model, model.initial_carry(2), tokens)
    assert logits.shape == (2, 81, 11) and carry[0].shape == (2, 97, 32)
    np.testing.assert_array_equal(q, -5.0)  # weight 0, bias -5


def graph(cls, extra):
    return nnx.split(cls(load_config(None, [f"model.name={NAMES[cls]}", *SMALL, *extra]).model, rngs=nnx.Rngs(0)))[0]


def test_trm_gradient_flows_only_through_the_last_cycle():
    model, graphdef, params, tokens = build(TRM, ["model.H_cycles=3", "model.L_cycles=2"])
    start = model.initial_carry(2)
    grads, carry_grads = grad_all(graphdef, params, start, tokens)
    assert all(float(jnp.abs(g).max()) == 0 for g in jax.tree.leaves(carry_grads))  # no path back to the start
    assert float(jnp.abs(grads["net"]["layers"]["mlp"]["w_down"][...]).max()) > 0
    # The same gradient as one cycle started, as a constant, where the two no-gradient cycles ended.
    after_two = nnx.merge(graph(TRM, ["model.H_cycles=2", "model.L_cycles=2"]), params)(
        start, tokens, jnp.zeros(2, jnp.int32)
    )[0]
    expected = grad_params(graph(TRM, ["model.H_cycles=1", "model.L_cycles=2"]), params, after_two, tokens)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4), grads, expected)


def test_hrm_one_step_gradient():
    hrm = ["model.H_layers=1", "model.L_layers=1", "model.H_cycles=2", "model.L_cycles=3"]
    model, graphdef, params, tokens = build(HRM, hrm)
    start = model.initial_carry(2)
    grads, carry_grads = grad_all(graphdef, params, start, tokens)
    assert all(float(jnp.abs(g).max()) == 0 for g in jax.tree.leaves(carry_grads))
    # Replay the no-gradient part by hand: 5 low-level updates, the high level after the third.
    z_h, z_l = start
    x = model.inputs(tokens, jnp.zeros(2, jnp.int32))
    rope = rope_tables(model.length, 16, 10000.0)  # head_dim 32 / 2 heads
    for step in range(5):
        z_l = model.low(z_l, z_h + x, rope)
        if step == 2:
            z_h = model.high(z_h, z_l, rope)
    one = ["model.H_layers=1", "model.L_layers=1", "model.H_cycles=1", "model.L_cycles=1"]
    expected = grad_params(graph(HRM, one), params, (z_h, z_l), tokens)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4), grads, expected)
    assert (
        float(jnp.abs(grads["low"]["layers"]["mlp"]["w_up"][...]).max()) > 0
        and float(jnp.abs(grads["high"]["layers"]["mlp"]["w_up"][...]).max()) > 0
    )


@pytest.mark.parametrize(
    "cls,extra",
    [(TRM, ["model.mlp_t=true", "model.H_cycles=2", "model.L_cycles=2"]), (HRM, ["model.H_layers=2"])],
    ids=["trm-mlp_t", "hrm"],
)
def test_recomputed_mlps_keep_outputs_and_gradients(cls, extra):
    """The blocks' MLPs keep only their input for the backward and compute the hidden layer again
    there (`swiglu_mlp`): the segment's outputs and gradients are those of the MLP autodiff saves."""
    results = [segment_and_gradients(cls, extra, recompute) for recompute in (True, False)]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4), *results)


def segment_and_gradients(cls, extra, recompute: bool):
    model, _, params, tokens = build(cls, extra)
    mlps = [m for _, m in nnx.iter_modules(model) if isinstance(m, SwiGLU)]
    assert mlps and all(m.recompute for m in mlps)  # what the models build
    for m in mlps:
        m.recompute = recompute
    graphdef, start = nnx.split(model)[0], model.initial_carry(2)

    def segment(p):
        carry, logits, q = nnx.merge(graphdef, p)(start, tokens, jnp.zeros(2, jnp.int32))
        return loss(graphdef, p, start, tokens), (carry, logits, q)

    return jax.jit(jax.value_and_grad(segment, has_aux=True))(params)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_norm_keeping_its_input_equals_rms_norm(dtype):
    """The blocks' norms keep x in its own dtype for the backward instead of its float32 copy."""
    x = (3 * jax.random.normal(jax.random.key(0), (2, 5, 64))).astype(dtype)
    weights = jax.random.normal(jax.random.key(1), x.shape)

    def value_and_grad(norm):
        return jax.value_and_grad(lambda x: (norm(x, 1e-5).astype(dtype).astype(jnp.float32) * weights).sum())(x)

    (ours, d_ours), (plain, d_plain) = value_and_grad(rms_norm_keeping_input), value_and_grad(rms_norm)
    np.testing.assert_allclose(ours, plain, rtol=1e-6)
    assert d_ours.dtype == dtype
    np.testing.assert_allclose(d_ours.astype(jnp.float32), d_plain.astype(jnp.float32), rtol=1e-5, atol=1e-6)
