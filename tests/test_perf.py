"""What is done for speed leaves the numbers as they were: the chunked loss equals the full one
(loss and gradients), the attention equals jax.nn.dot_product_attention (outputs and gradients),
unrolled layers equal the scan, on one device and on a mesh. And the throughput bench runs."""

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from podtrain.config.parallel import MeshConfig
from podtrain.models import build_model
from podtrain.models.attention import grouped_attention
from podtrain.models.layers import output_head, swiglu
from podtrain.program.load import load_config
from podtrain.program.tasks import language as lm
from podtrain.runtime.mesh import build_mesh
from podtrain.sharding import sharded_jit

from compile_flags import TEST_COMPILES
from helpers import LANGUAGE_FAMILIES

ROOT = Path(__file__).parent.parent


@functools.cache
def loss_and_grads(overrides: tuple[str, ...], mesh_shape=(1, 1, 1)):
    """The next-token loss of a fixed batch and its gradient, on a mesh of data x fsdp x tensor."""
    cfg = load_config(None, list(overrides))
    graphdef, params = nnx.split(build_model(cfg.model, nnx.Rngs(0)))
    tokens = jax.random.randint(jax.random.key(1), (8, 33), 0, cfg.model.vocab_size)
    mesh = build_mesh(
        MeshConfig(**dict(zip(("data", "fsdp", "tensor"), mesh_shape))), jax.devices()[: int(np.prod(mesh_shape))]
    )
    loss = lambda p: lm.next_token_loss(nnx.merge(graphdef, p), None, tokens, None)[0]  # noqa: E731
    return jax.device_get(sharded_jit(jax.value_and_grad(loss), mesh)(params))


@pytest.mark.parametrize(
    "chunk,mesh_shape", [(8, (1, 1, 1)), (12, (1, 1, 1)), (12, (2, 1, 2))], ids=["8", "12-short-last", "12-data-tensor"]
)
def test_chunked_loss_equals_full_loss_and_gradients(chunk, mesh_shape, small_overrides):
    full_loss, full_grads = loss_and_grads(tuple(small_overrides), mesh_shape)
    loss, grads = loss_and_grads((*small_overrides, f"model.loss_chunk={chunk}"), mesh_shape)
    np.testing.assert_allclose(loss, full_loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads, full_grads)


def test_chunked_loss_keeps_one_chunk_of_logits(small_overrides):
    """Compiled for a large vocabulary, the chunked step's temporaries are a fraction of the full one's."""
    big = [*small_overrides, "model.vocab_size=16384"]
    cfg = load_config(None, big)
    tokens = jnp.zeros((8, 33), jnp.int32)

    def temporaries(overrides):
        graphdef, params = nnx.split(build_model(load_config(None, overrides).model, nnx.Rngs(0)))
        grad = jax.jit(jax.grad(lambda p: lm.next_token_loss(nnx.merge(graphdef, p), None, tokens, None)[0]))
        return grad.lower(params).compile().memory_analysis().temp_size_in_bytes

    logits_bytes = 8 * 32 * cfg.model.vocab_size * 4
    full, chunked = temporaries(big), temporaries([*big, "model.loss_chunk=4"])
    assert full > 2 * logits_bytes and chunked < full - 1.5 * logits_bytes


def attention_inputs(n_heads=8, n_kv_heads=2, t=256, h=8):  # 8 causal blocks of 32 queries
    q = jax.random.normal(jax.random.key(0), (2, t, n_heads, h))
    k, v = jax.random.normal(jax.random.key(1), (2, 2, t, n_kv_heads, h))
    return q, k, v


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("documents", [False, True])
def test_grouped_attention_equals_dot_product_attention(causal, documents):
    q, k, v = attention_inputs()
    segments = jnp.array([[0] * 80 + [1] * 176, [0] * 144 + [1] * 112])
    mask = (segments[:, :, None] == segments[:, None, :])[:, None] if documents else None
    cotangent = jax.random.normal(jax.random.key(2), q.shape)

    @functools.partial(jax.jit, static_argnums=0)
    def with_grads(attend, q, k, v):
        out, pullback = jax.vjp(attend, q, k, v)
        return out, pullback(cotangent)

    pair = (segments, segments) if documents else None  # the same rule in O(T): segment ids
    ours = with_grads(lambda q, k, v: grouped_attention(q, k, v, causal, segments=pair), q, k, v)
    reference = with_grads(
        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, implementation="xla"),
        q,
        k,
        v,
    )
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), ours, reference)


def test_swiglu_gradient_equals_autodiff():
    gate_up = jax.random.normal(jax.random.key(0), (4, 8, 2, 16)) * 3
    plain = lambda x: jax.nn.silu(x[..., 0, :]) * x[..., 1, :]  # noqa: E731
    cotangent = jax.random.normal(jax.random.key(1), (4, 8, 16))
    ours, reference = (jax.vjp(f, gate_up) for f in (swiglu, plain))
    np.testing.assert_allclose(ours[0], reference[0], rtol=1e-6)
    np.testing.assert_allclose(ours[1](cotangent)[0], reference[1](cotangent)[0], rtol=1e-5, atol=1e-6)


def test_the_heads_gradient_matmuls_run_in_the_compute_dtype():
    """The logits come out in float32; their gradient enters the head's backward matmuls in bfloat16
    (as torch autocast's does), and in float32 compute the gradients are autodiff's."""
    x, head = (jax.random.normal(jax.random.key(i), shape) for i, shape in enumerate([(2, 8, 16), (16, 64)]))
    d_logits = jax.random.normal(jax.random.key(2), (2, 8, 64))
    plain = lambda x, head, dtype: jnp.matmul(  # noqa: E731
        x.astype(dtype), head.astype(dtype), preferred_element_type=jnp.float32
    )

    def logits_and_grads(f, dtype):
        logits, vjp = jax.vjp(functools.partial(f, dtype=dtype), x, head)
        return logits, vjp(d_logits)

    for dtype, tolerance in ((jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)):
        (logits, grads), (reference, reference_grads) = (logits_and_grads(f, dtype) for f in (output_head, plain))
        assert logits.dtype == jnp.float32
        np.testing.assert_array_equal(logits, reference)
        for ours, theirs in zip(grads, reference_grads):
            assert np.linalg.norm(ours - theirs) <= tolerance * np.linalg.norm(theirs)
    backward = jax.jit(jax.grad(lambda x, head: output_head(x, head, jnp.bfloat16).sum(), argnums=(0, 1)))
    dots = re.findall(r"dot_general.*", backward.lower(x, head).as_text())
    assert len(dots) == 2 and all("f32" not in d for d in dots), dots  # operands and results bfloat16


@pytest.mark.parametrize("model", LANGUAGE_FAMILIES)
def test_unrolled_layers_equal_the_scan(model, small_overrides):
    """model.scan_unroll=n_layers unrolls the scan in full (~1.05x faster on the cpu preset, 1.23x
    for mhc_tiny.yaml): the loss and gradients of the scan."""
    overrides = (*small_overrides, f"model.name={model}")
    scanned = loss_and_grads(overrides)
    unrolled = loss_and_grads((*overrides, "model.scan_unroll=2"))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), unrolled, scanned)


@pytest.mark.integration
def test_throughput_bench_runs_tiny():
    """End to end on CPU in its tiny mode: each side in a process of its own (two processes, neither
    the script's), both training one warmup step from a loss near log(vocabulary), then one timed
    repeat whose rates are positive and whose printed ratio is reference time / podtrain time, that
    is podtrain's tokens/s over the reference's (to the rounding of the printed numbers); min,
    median and max of one repeat are that ratio, printed once."""
    env = {**os.environ, "XLA_FLAGS": TEST_COMPILES}  # one CPU device, not the tests' eight
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "throughput.py"), "--tiny"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    number = r"([0-9][0-9,]*\.?[0-9]*)"
    losses = re.search(rf"loss after 1 warmup steps: podtrain {number}, reference {number}", out)
    repeats = re.findall(rf"repeat \d+: podtrain {number} tokens/s, reference {number} tokens/s.*ratio {number}", out)
    summary = re.search(rf"ratio podtrain/reference: min {number}  median {number}  max {number}", out)
    assert losses and len(repeats) == 1 and summary and out.count("ratio podtrain/reference") == 1, out
    processes = re.search(
        r"podtrain in process (\d+), reference \(PyTorch .*\) in process (\d+) \(this script: (\d+)\)", out
    )
    assert processes and len(set(processes.groups())) == 3, out
    vocab = load_config(None, []).model.vocab_size  # the bench's tiny model keeps the default vocabulary
    for loss in map(float, losses.groups()):
        assert abs(loss - np.log(vocab)) < 0.1, (loss, out)  # small initial weights: about uniform
    ours, reference, ratio = (float(x.replace(",", "")) for x in repeats[0])
    assert ours > 0 and reference > 0 and ratio > 0, out
    # tokens/s is printed to the token and the ratio to 1e-3: their rounding bounds the difference.
    rounding = 5e-4 + (ours / reference) * (0.5 / ours + 0.5 / reference)
    assert abs(ratio - ours / reference) <= rounding, out
    assert [float(x) for x in summary.groups()] == [ratio] * 3, out
