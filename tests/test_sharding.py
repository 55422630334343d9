"""The same training steps give the same numbers on every mesh shape, and with accumulation."""

import jax
import numpy as np
import pytest

from helpers import run_steps

MESHES = [(8, 1, 1), (1, 8, 1), (1, 1, 8), (2, 2, 2), (2, 4, 1)]


@pytest.fixture(scope="module")
def reference():
    from helpers import SMALL

    return run_steps(SMALL + ["mesh.data=1"], n_devices=1)


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_sharded_equals_unsharded(shape, reference, small_overrides):
    data, fsdp, tensor = shape
    losses, params = run_steps(
        small_overrides + [f"mesh.data={data}", f"mesh.fsdp={fsdp}", f"mesh.tensor={tensor}"], n_devices=8
    )
    ref_losses, ref_params = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    assert losses[-1] < losses[0]  # the steps really trained
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-4), params, ref_params)


def test_kv_heads_repeated_over_a_wider_tensor_axis(small_overrides):
    """Two k/v heads for eight query heads on tensor=8: each shard gets a copy of its k/v head."""
    heads = ["model.n_heads=8", "model.n_kv_heads=2"]
    ref_losses, ref_params = run_steps(small_overrides + heads + ["mesh.data=1"], n_devices=1)
    losses, params = run_steps(small_overrides + heads + ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=8"], n_devices=8)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-4), params, ref_params)


def test_grad_accumulation_equals_full_batch(small_overrides):
    full, full_params = run_steps(small_overrides + ["mesh.data=1"], n_devices=1)
    accum, accum_params = run_steps(small_overrides + ["mesh.data=1", "train.grad_accum=4"], n_devices=1)
    np.testing.assert_allclose(accum, full, rtol=0, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-4), accum_params, full_params)


def test_grad_accumulation_on_a_mesh(small_overrides):
    full, _ = run_steps(small_overrides + ["mesh.data=1"], n_devices=1)
    accum, _ = run_steps(
        small_overrides + ["mesh.data=2", "mesh.fsdp=1", "mesh.tensor=4", "train.grad_accum=4"], n_devices=8
    )
    np.testing.assert_allclose(accum, full, rtol=0, atol=1e-5)


def test_ema_follows_the_weights(small_overrides):
    from helpers import trainer

    state, step, batches = trainer(
        small_overrides + ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "train.ema=0.75"], n_devices=8
    )
    expected = jax.device_get(state["ema"])
    for i in range(2):
        state, _ = step(state, batches[i])
        expected = jax.tree.map(lambda e, p: 0.75 * e + 0.25 * p, expected, jax.device_get(state["params"]))
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-6), jax.device_get(state["ema"]), expected
    )
    assert state["ema"]["embed"].sharding == state["params"]["embed"].sharding


FAMILY_OPTIONS = {
    # Qwen3's q/k norms, Qwen2's biases, an explicit head_dim, a window on all but the first layer
    "qwen": ["model.qk_norm=true", "model.attention_bias=qkv", "model.head_dim=12", "model.sliding_window=8"]
    + ["model.full_attention_layers=[0]"],
    # Gemma 2 and 3: (1 + w) norms, post-norms, GeGLU, a scaled embedding, soft-caps, the query scale,
    # a sliding first layer with its own RoPE base
    "gemma": ["model.norm_plus_one=true", "model.post_norms=true", "model.mlp_activation=gelu_tanh"]
    + ["model.scale_embedding=true", "model.attn_softcap=5", "model.final_softcap=10", "model.qk_norm=true"]
    + ["model.query_pre_attn_scalar=16", "model.sliding_window=8", "model.full_attention_layers=[1]"]
    + ["model.rope_theta=1000000", "model.rope_local_theta=10000"],
}


@pytest.mark.parametrize("family", FAMILY_OPTIONS)
def test_family_options_sharded_equal_unsharded(small_overrides, family):
    """The Hugging Face families' options of the decoder on a 2x2x2 mesh, against one device."""
    options = FAMILY_OPTIONS[family]
    ref_losses, ref_params = run_steps(small_overrides + options + ["mesh.data=1"], n_devices=1)
    losses, params = run_steps(small_overrides + options + ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"], n_devices=8)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    assert losses[-1] < losses[0]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-4), params, ref_params)
