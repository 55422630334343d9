"""mHC: the projections are doubly stochastic, n=1 with identity mixing is Llama, and it shards like Llama."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SMALL
from helpers import run_steps

from podtrain.config import MeshConfig, load_config
from podtrain.models.mhc import permutation_mixture, sinkhorn
from podtrain.runtime.mesh import RULES, build_mesh
from podtrain.train.state import model_fns

MHC = SMALL + ["model.name=mhc", "model.mhc.streams=4"]


def assert_doubly_stochastic(p, atol=1e-5):
    assert bool(jnp.isfinite(p).all())
    np.testing.assert_allclose(p.sum(-1), 1, atol=atol)
    np.testing.assert_allclose(p.sum(-2), 1, atol=atol)


def test_sinkhorn_is_doubly_stochastic():
    logits = jax.random.uniform(jax.random.key(0), (256, 4, 4), minval=-1, maxval=1)
    assert_doubly_stochastic(sinkhorn(logits, 20))


def test_sinkhorn_stays_finite_at_1e4_in_bfloat16():
    identity = jnp.where(jnp.eye(4, dtype=bool), 1e4, -1e4)
    extreme = jnp.stack([identity, -identity]).astype(jnp.bfloat16)
    assert_doubly_stochastic(sinkhorn(extreme, 20))
    random_signs = (jnp.sign(jax.random.normal(jax.random.key(1), (64, 4, 4))) * 1e4).astype(jnp.bfloat16)
    p = sinkhorn(random_signs, 20)
    assert bool(jnp.isfinite(p).all()) and p.dtype == jnp.float32
    np.testing.assert_allclose(p.sum(-1), 1, atol=1e-5)  # rows are normalised last


def test_permutation_mixture_is_exactly_doubly_stochastic():
    assert_doubly_stochastic(permutation_mixture(jax.random.normal(jax.random.key(2), (16, 24)) * 1e4, 4), atol=1e-6)


def _model(overrides):
    """(model functions, initial params, tokens) on one device."""
    cfg = load_config(None, overrides)
    fns = model_fns(cfg, build_mesh(MeshConfig(1, 1, 1), jax.devices()[:1]))
    params = fns.init(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(3), (2, 16), 0, 256)
    return fns, params, tokens


def test_one_stream_with_identity_mixing_is_llama():
    llama, llama_params, tokens = _model(SMALL)
    mhc, params, _ = _model(SMALL + ["model.name=mhc", "model.mhc.streams=1"])
    shared = {k: v for k, v in llama_params.items() if k != "layers"}
    layers = {**params["layers"], **llama_params["layers"]}
    for mixer in ("attn_mix", "mlp_mix"):
        n_layers, size = layers[mixer]["bias"].shape  # pre, post, res: one each for n=1
        layers[mixer] = {**layers[mixer], "alpha": jnp.zeros_like(layers[mixer]["alpha"])}
        layers[mixer]["bias"] = jnp.tile(jnp.array([30.0, 0.0, 0.0]), (n_layers, 1))  # H_pre = σ(30) = 1.0, H_post = 2σ(0) = 1
    identity = {**params, **shared, "layers": layers}
    np.testing.assert_allclose(mhc.apply(identity, tokens), llama.apply(llama_params, tokens), rtol=0, atol=1e-5)
    assert not np.allclose(mhc.apply(params, tokens), llama.apply(llama_params, tokens), atol=1e-3)  # the mixing matters


@pytest.fixture(scope="module")
def unsharded():
    return {p: run_steps(MHC + [f"model.mhc.projection={p}", "mesh.data=1"], n_devices=1) for p in ("sinkhorn", "permutations")}


@pytest.mark.parametrize("projection,shape", [("sinkhorn", (2, 2, 2)), ("sinkhorn", (1, 1, 8)), ("permutations", (2, 2, 2))])
def test_sharded_equals_unsharded(projection, shape, unsharded):
    overrides = MHC + [f"model.mhc.projection={projection}"]
    ref_losses, ref_params = unsharded[projection]
    losses, params = run_steps(overrides + [f"mesh.data={shape[0]}", f"mesh.fsdp={shape[1]}", f"mesh.tensor={shape[2]}"], n_devices=8)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    assert losses[-1] < losses[0]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-4), params, ref_params)


def test_streams_are_a_logical_axis_never_sharded():
    cfg = load_config(None, MHC)
    fns = model_fns(cfg, build_mesh(MeshConfig(1, 2, 4), jax.devices()))
    mixer = fns.logical_axes["layers"]["attn_mix"]
    assert mixer["phi"] == ("layers", "embed", "streams") and mixer["bias"] == ("layers", "streams")
    assert RULES["streams"] == ()
    spec = fns.abstract_params["layers"]["attn_mix"]["phi"].sharding.spec
    assert spec[2] is None and spec[1] == "fsdp"


def test_bfloat16_streams_are_mixed_in_float32():
    """Equal streams stay equal under a doubly stochastic H_res: in float32 the row sums are 1 to
    ~1e-7, so streams of ones come back exactly 1 in bfloat16; H_res rounded to bfloat16 first would not."""
    from flax import nnx

    from podtrain.models.mhc import StreamMixer

    cfg = load_config(None, MHC + ["model.compute_dtype=bfloat16", "model.mhc.alpha_init=3.0"]).model
    mixer = StreamMixer(cfg, nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 16, 4, cfg.d_model)).astype(jnp.bfloat16)
    h_res = mixer.coefficients(x)[2]
    assert float(jnp.abs(h_res - h_res.astype(jnp.bfloat16).astype(jnp.float32)).max()) > 1e-4  # bfloat16 would round it
    ones = jnp.ones_like(x)
    mixer.coefficients = lambda _: tuple(jnp.asarray(h) for h in StreamMixer.coefficients(mixer, x))  # the diverse H_res of x
    out = mixer(ones, lambda y: jnp.zeros_like(y))
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out, np.float32), 1.0)
