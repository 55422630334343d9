"""What is done for speed leaves the numbers as they were: the attention equals
jax.nn.dot_product_attention and SwiGLU its autodiff (outputs and gradients). And the throughput bench runs."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from podtrain.models.layers import grouped_attention, swiglu

ROOT = Path(__file__).parent.parent


def attention_inputs(n_heads=8, n_kv_heads=2, t=16, h=8):
    q = jax.random.normal(jax.random.key(0), (2, t, n_heads, h))
    k, v = jax.random.normal(jax.random.key(1), (2, 2, t, n_kv_heads, h))
    return q, k, v


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("documents", [False, True])
def test_grouped_attention_equals_dot_product_attention(causal, documents):
    q, k, v = attention_inputs()
    segments = jnp.array([[0] * 5 + [1] * 11, [0] * 9 + [1] * 7])
    mask = (segments[:, :, None] == segments[:, None, :])[:, None] if documents else None
    cotangent = jax.random.normal(jax.random.key(2), q.shape)

    def with_grads(attend):
        out, pullback = jax.vjp(attend, q, k, v)
        return out, pullback(cotangent)

    ours = with_grads(lambda q, k, v: grouped_attention(q, k, v, mask, causal))
    reference = with_grads(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, implementation="xla"))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), ours, reference)


def test_swiglu_gradient_equals_autodiff():
    gate_up = jax.random.normal(jax.random.key(0), (4, 8, 2, 16)) * 3
    plain = lambda x: jax.nn.silu(x[..., 0, :]) * x[..., 1, :]  # noqa: E731
    cotangent = jax.random.normal(jax.random.key(1), (4, 8, 16))
    ours, reference = (jax.vjp(f, gate_up) for f in (swiglu, plain))
    np.testing.assert_allclose(ours[0], reference[0], rtol=1e-6)
    np.testing.assert_allclose(ours[1](cotangent)[0], reference[1](cotangent)[0], rtol=1e-5, atol=1e-6)


def test_throughput_bench_runs_tiny():
    """End to end on CPU in its tiny mode: both sides train and the ratio line is printed (no timing asserted)."""
    env = {**os.environ, "XLA_FLAGS": ""}  # one CPU device, as a user has, not the tests' eight
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "throughput.py"), "--tiny"], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "ratio podtrain/reference: min" in result.stdout
