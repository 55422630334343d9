"""The Llama model itself: causal, grouped-query, precision policy."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from podtrain.config import load_config
from podtrain.models import build_model


def small_model(overrides, extra=()):
    return build_model(load_config(None, overrides + list(extra)).model, nnx.Rngs(0))


def test_logits_do_not_see_the_future(small_overrides):
    model = small_model(small_overrides)
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 256)
    changed = tokens.at[:, 10:].set((tokens[:, 10:] + 7) % 256)
    a, b = model(tokens), model(changed)
    np.testing.assert_allclose(a[:, :10], b[:, :10], atol=1e-5)
    assert not np.allclose(a[:, 10:], b[:, 10:])


def test_grouped_query_attention_shapes(small_overrides):
    params = nnx.state(small_model(small_overrides))
    assert params["layers"]["attn"]["wq"].shape == (2, 32, 4, 8)  # layers, d_model, n_heads, head_dim
    assert params["layers"]["attn"]["wk"].shape == (2, 32, 2, 8)  # n_kv_heads=2


def test_bfloat16_compute_keeps_float32_params_and_logits(small_overrides):
    model = small_model(small_overrides, ["model.compute_dtype=bfloat16"])
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(model)))
    logits = model(jax.random.randint(jax.random.key(0), (2, 8), 0, 256))
    assert logits.dtype == jnp.float32
    # accumulated in float32, not rounded to bfloat16 and cast afterwards
    assert (logits != logits.astype(jnp.bfloat16).astype(jnp.float32)).mean() > 0.9
