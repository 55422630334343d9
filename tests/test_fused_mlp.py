"""The recursive models' MLP as one Pallas kernel for TPU (`podtrain/models/fused_mlp.py`), run by
its interpreter on the CPU: outputs and gradients equal to the XLA path's, on one device and on a
mesh; compiled ahead of time for a TPU, the TRM step moves a fraction of the XLA path's bytes."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from podtrain.config.parallel import MeshConfig
from podtrain.models.fused_mlp import fused_swiglu_mlp
from podtrain.models.layers import swiglu_mlp
from podtrain.planning import plan
from podtrain.planning import targets as hardware
from podtrain.program.load import load_config
from podtrain.runtime.mesh import build_mesh
from podtrain.sharding import sharded_jit

from helpers import needs_libtpu

CONFIGS = Path(__file__).parent.parent / "configs"
ROWS = ("act_batch", "act_seq", "act_embed")
TOKENS = ("act_batch", "act_embed", "act_seq")  # mlp_t's MLP over the sequence


def _inputs(shape, d_ff):
    keys = jax.random.split(jax.random.key(0), 4)
    d = shape[-1]
    x = jax.random.normal(keys[0], shape)
    w_in = jax.random.normal(keys[1], (d, 2, d_ff)) / d**0.5
    w_down = jax.random.normal(keys[2], (d_ff, d)) / d_ff**0.5
    return x, w_in, w_down, jax.random.normal(keys[3], shape)


def _value_and_grads(mlp, x, w_in, w_down, cotangent):
    return jax.value_and_grad(lambda *a: (mlp(*a) * cotangent).sum(), argnums=(0, 1, 2))(x, w_in, w_down)


@pytest.mark.parametrize(
    "shape,d_ff,axes",
    [((3, 97, 64), 256, ROWS), ((2, 64, 85), 128, TOKENS), ((2, 300, 32), 1280, ROWS)],
    ids=["rows-padded", "over-the-sequence", "three-hidden-blocks"],
)
def test_kernel_equals_xla(shape, d_ff, axes):
    """Rows padded to whole blocks, a contracted axis of 85 (not a multiple of 128), and a hidden
    layer of 1280 split into blocks of 512 for the weight gradients (the last one partial)."""
    x, w_in, w_down, cotangent = _inputs(shape, d_ff)
    fused = _value_and_grads(lambda *a: fused_swiglu_mlp(*a, axes, interpret=True), x, w_in, w_down, cotangent)
    xla = _value_and_grads(lambda *a: swiglu_mlp(*a, axes), x, w_in, w_down, cotangent)
    np.testing.assert_allclose(fused[0], xla[0], rtol=1e-6)
    for mine, theirs in zip(fused[1], xla[1]):
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-5 * float(jnp.abs(theirs).max()))


def test_kernel_on_each_device_equals_one_device():
    """On a data x fsdp mesh each device runs the kernel on its rows; the weights' gradients are
    summed over the devices by the partitioner, as for the XLA path."""
    mesh = build_mesh(MeshConfig(data=2, fsdp=2, tensor=1), jax.devices()[:4])
    x, w_in, w_down, cotangent = _inputs((8, 40, 64), 256)

    def grads(x, w_in, w_down, cotangent):
        return _value_and_grads(lambda *a: fused_swiglu_mlp(*a, ROWS, interpret=True), x, w_in, w_down, cotangent)

    rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    placed = [
        jax.device_put(a, rows if a.ndim == 3 else NamedSharding(mesh, PartitionSpec()))
        for a in (x, w_in, w_down, cotangent)
    ]
    sharded = sharded_jit(grads, mesh)(*placed)
    alone = jax.jit(grads)(x, w_in, w_down, cotangent)
    np.testing.assert_allclose(sharded[0], alone[0], rtol=1e-6)
    for mine, theirs in zip(sharded[1], alone[1]):  # summed in another order
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-5 * float(jnp.abs(theirs).max()))


@pytest.mark.integration
@needs_libtpu
def test_trm_pod_recipe_on_v4_64_runs_the_kernel_and_is_compute_bound():
    """`auto` picks the kernel on TPU; compiled ahead of time for a v4-64 (16 MiB of VMEM a core),
    configs/trm_sudoku_pod.yaml's step (with 1 x 1 cycles, to compile faster) moves less through HBM
    than its matmuls take (the full recipe with XLA's MLP was memory-bound: 45.6 GiB and 40.8 ms of
    memory against 33.8 ms of compute), and the kernels declare their FLOPs to the plan,
    recomputation included."""
    cfg = load_config(CONFIGS / "trm_sudoku_pod.yaml", ["model.H_cycles=1", "model.L_cycles=1"])
    p = plan.plan(cfg, hardware.target("v4-64"), remedy=False)
    assert p.cfg.model.mlp_kernel == "pallas" and p.fits
    kernels = [o for o in p.top_flops if o.op == "custom-call"]
    assert kernels and all(o.source.startswith("fused_mlp.py:") for o in kernels)
    assert p.matmul_flops * len(p.target.devices) > p.flops_per_step
    assert p.times["memory"] < p.times["compute"]
