"""Low-precision matmuls (model.matmul_precision, models/ops.py): the products really run in fp8 or
int8 forward and backward, train as well as the compute dtype, shard like it, and plans count them
at the chips' narrow rates."""

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
import pytest
from podtrain.models import ops
from podtrain.planning import plan, report
from podtrain.planning import targets as hardware
from podtrain.program.load import load_config
from podtrain.train.metrics import read_metrics

from helpers import SMALL, needs_cuda_compiler, needs_libtpu, podtrain, run_steps

NARROW_TYPES = {"fp8": {jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)}, "int8": {jnp.dtype(jnp.int8)}}


def _dots(jaxpr) -> list:
    """The operand dtypes of every dot_general in a jaxpr, those of the jaxprs inside it included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append({jnp.dtype(v.aval.dtype) for v in eqn.invars})
        for param in eqn.params.values():
            for inner in param if isinstance(param, (list, tuple)) else [param]:
                if isinstance(inner, (jex.core.Jaxpr, jex.core.ClosedJaxpr)):
                    found += _dots(getattr(inner, "jaxpr", inner))
    return found


@pytest.mark.parametrize("policy, tolerance", [("fp8", 0.08), ("int8", 0.02)])
def test_a_policy_multiplies_narrow_forward_and_backward_and_stays_close(policy, tolerance):
    keys = jax.random.split(jax.random.key(0), 3)
    x, w = jax.random.normal(keys[0], (2, 16, 64)), jax.random.normal(keys[1], (64, 2, 32))
    spec, weights = "...d,dkf->...kf", jax.random.normal(keys[2], (2, 16, 2, 32))

    def loss(x, w):
        return jnp.sum(ops.dot(spec, x, w, jnp.float32) * weights)

    with ops.policy(policy):
        value, grads = jax.value_and_grad(loss, argnums=(0, 1))(x, w)
        traced = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1)))(x, w).jaxpr
    exact, exact_grads = jax.value_and_grad(loss, argnums=(0, 1))(x, w)

    dots = _dots(traced)
    assert len(dots) == 3  # the forward product and both of its gradients
    assert all(operands <= NARROW_TYPES[policy] for operands in dots), dots
    out = ops.dot(spec, x, w, jnp.float32)
    with ops.policy(policy):
        narrow = ops.dot(spec, x, w, jnp.float32)
    assert 0 < float(jnp.abs(narrow - out).max()) < tolerance * float(jnp.abs(out).max())
    for g, e in zip(grads, exact_grads):
        assert float(jnp.abs(g - e).max()) < 2 * tolerance * float(jnp.abs(e).max())
    assert abs(float(value) - float(exact)) < tolerance * float(jnp.abs(weights).sum())


@pytest.mark.parametrize("policy", ["fp8", "int8"])
def test_the_scales_follow_the_tensors_magnitude(policy):
    """Each operand is scaled to the format's range where it is used: far beyond fp8's largest
    value (448) or far below its smallest normal, the product is the same up to the power of two."""
    keys = jax.random.split(jax.random.key(1), 2)
    x, w = jax.random.normal(keys[0], (8, 64)), jax.random.normal(keys[1], (64, 32))
    with ops.policy(policy):
        plain, big, small = (ops.dot("td,df->tf", x * c, w, jnp.float32) for c in (1.0, 2.0**20, 2.0**-20))
    assert bool(jnp.all(jnp.isfinite(big)))
    np.testing.assert_array_equal(big, plain * 2.0**20)
    np.testing.assert_array_equal(small, plain * 2.0**-20)


def test_sharded_fp8_steps_equal_one_device():
    """fsdp x tensor on 8 devices: the same losses and weights as one device, under fp8 (the
    per-row scales are maxima, which the partitioner reduces exactly)."""
    overrides = [*SMALL, "model.matmul_precision=fp8", "train.lr=1e-2"]
    one, params_one = run_steps([*overrides, "mesh.data=1"], 1)
    split, params_split = run_steps([*overrides, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"], 8)
    exact, _ = run_steps([*SMALL, "train.lr=1e-2"], 1)
    np.testing.assert_allclose(split, one, rtol=1e-4)
    assert not np.allclose(one, exact, rtol=1e-6)  # fp8 really rounded
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5), params_split, params_one)


def _plan(path: str, target: str, *overrides: str) -> plan.Plan:
    return plan.plan(load_config(path, list(overrides)), hardware.target(target))


@pytest.mark.integration
@needs_cuda_compiler
def test_an_fp8_gpu_plan_multiplies_the_layers_in_fp8_at_the_fp8_rate():
    bf16 = _plan("configs/tiny.yaml", "h100", "model.scan_unroll=1")
    fp8 = _plan("configs/tiny.yaml", "h100", "model.scan_unroll=1", "model.matmul_precision=fp8")
    assert bf16.narrow_flops == 0
    # Every layer's projection is an fp8 GEMM; the output head (bf16) is the rest.
    head = 2 * 3 * bf16.tokens_per_step * bf16.cfg.model.d_model * bf16.cfg.model.vocab_size
    assert fp8.narrow_flops == pytest.approx(fp8.matmul_flops - head, rel=0.02)
    assert fp8.times["compute"] < 0.65 * bf16.times["compute"]
    assert "in fp8, at 1,979 TFLOP/s" in report.report(fp8)


@needs_cuda_compiler
def test_fp8_on_a_card_without_it_is_said_to_bring_nothing():
    said = report.report(_plan("configs/tiny.yaml", "a100", "model.scan_unroll=1", "model.matmul_precision=fp8"))
    assert "fp8 matmuls run no faster than bf16 on the NVIDIA A100 SXM" in said


@pytest.mark.integration
@needs_libtpu
def test_an_int8_tpu_plan_multiplies_in_int8_at_the_int8_rate():
    bf16 = _plan("configs/tiny.yaml", "v6e-1")
    int8 = _plan("configs/tiny.yaml", "v6e-1", "model.matmul_precision=int8")
    assert int8.narrow_flops > 0.8 * int8.matmul_flops
    assert int8.times["compute"] < 0.65 * bf16.times["compute"]
    said = report.report(_plan("configs/tiny.yaml", "v4-8", "model.matmul_precision=int8"))
    assert "int8 matmuls run no faster than bf16 on the TPU v4" in said


@pytest.mark.integration
@needs_cuda_compiler
def test_remat_saves_memory_with_the_layers_unrolled():
    """jax.checkpoint's recomputation survives unrolling (without CSE's guard XLA merged it back
    into the forward pass: remat full and none took the same memory unrolled)."""
    temporaries = {
        remat: _plan("configs/tiny.yaml", "h100", f"model.remat={remat}", "model.scan_unroll=4").memory.temporaries
        for remat in ("none", "full")
    }
    assert temporaries["full"] < 0.5 * temporaries["none"]


@pytest.mark.integration
def test_the_tiny_recipe_learns_as_well_in_fp8_and_int8(tmp_path):
    """100 steps of the shipped tiny recipe under each policy (XLA's CPU backend emulates the
    formats): held-out losses within 3% of the compute dtype's."""
    val = {}
    for policy in ("compute", "fp8", "int8"):
        run = tmp_path / policy
        done = podtrain(
            "train", "configs/tiny.yaml", "train.steps=100", f"run_dir={run}", f"model.matmul_precision={policy}"
        )
        assert done.returncode == 0, done.stderr[-2000:]
        val[policy] = [r["val_loss"] for r in read_metrics(run) if "val_loss" in r][-1]
    for policy in ("fp8", "int8"):
        assert abs(val[policy] - val["compute"]) < 0.03 * val["compute"], val
