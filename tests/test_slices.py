"""Meshes over several slices (TPU slices, or processes off a TPU): each slice holds the axes'
inner sizes and the dcn_ sizes span the slices, so only those axes' collectives cross the
network; the job trains as on one device; a plan for N slices counts what crosses."""

import jax
import numpy as np
import pytest
from podtrain.errors import MeshError
from podtrain.planning import hlo, plan, report
from podtrain.planning import targets as hardware
from podtrain.program.job import build
from podtrain.program.load import load_config
from podtrain.runtime.mesh import build_mesh, describe

from helpers import SMALL, needs_libtpu, run_steps

ACROSS = ["mesh.dcn_data=2", "mesh.data=2", "mesh.fsdp=2"]  # 8 devices: 2 slices of data=2 x fsdp=2


def test_each_slice_holds_the_inner_axes():
    cfg = load_config(None, SMALL + ACROSS)
    mesh = build_mesh(cfg.mesh, jax.devices())
    assert dict(mesh.shape) == {"data": 4, "stage": 1, "fsdp": 2, "context": 1, "expert": 1, "tensor": 1}
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    # One process's 8 devices stand for 2 slices of 4: the first holds data 0-1, the second 2-3.
    assert set(ids[:2].ravel()) == {0, 1, 2, 3} and set(ids[2:].ravel()) == {4, 5, 6, 7}
    described = "mesh data=2x2 stage=1 fsdp=2 context=1 expert=1 tensor=1 on 2 slices of 4 devices"
    assert describe(mesh, cfg.mesh) == described
    with pytest.raises(MeshError, match="do not split evenly into 3 slices"):
        build_mesh(load_config(None, ["mesh.dcn_data=3"]).mesh, jax.devices())
    with pytest.raises(MeshError, match="needs 8 devices per slice but 4 are available"):
        build_mesh(load_config(None, ["mesh.dcn_fsdp=2", "mesh.data=8"]).mesh, jax.devices())


def test_only_the_dcn_axes_cross_slices():
    """fsdp's weight gathers stay inside a slice; what crosses slices are the reductions over the
    batch, which includes data (read from the compiled program's replica groups)."""
    cfg = load_config(None, SMALL + ACROSS)
    mesh = build_mesh(cfg.mesh, jax.devices())
    found = hlo.collectives(build(cfg, mesh, data=False).compile().as_text())
    slice_of = [d.id // 4 for d in mesh.devices.flat]
    sizes = dict(mesh.shape)
    crossing = [c for c in found if len({slice_of[i] for i in hlo.group(c)}) > 1]
    inside = [c for c in found if c not in crossing]
    assert crossing and all("data" in hlo.mesh_axes(c, sizes) and c.kind == "all-reduce" for c in crossing)
    assert any(c.kind == "all-gather" and hlo.mesh_axes(c, sizes) == ("fsdp",) for c in inside)


def test_slices_train_like_one_device():
    losses, params = run_steps(SMALL + ACROSS, n_devices=8, n_steps=2)
    one_losses, one_params = run_steps(SMALL + ["mesh.data=1"], n_devices=1, n_steps=2)
    np.testing.assert_allclose(losses, one_losses, rtol=0, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5), params, one_params)


@needs_libtpu
def test_a_plan_for_two_slices_counts_the_network():
    """`--target 2xv4-8`: two 4-chip slices as the TPU compiler sees them; what crosses slices
    is the Megascale runtime's host transfers, timed at the chip's DCN bandwidth."""
    target = hardware.target("2xv4-8")
    assert target.slices == 2 and len(target.devices) == 8 and target.label.startswith("2xv4-8: 2 slices of 4 x")
    cfg = load_config(None, [o for o in SMALL if "compute_dtype" not in o] + ["mesh.dcn_data=2", "mesh.data=4"])
    p = plan.plan(cfg, target)
    assert p.fits and p.mesh["data"] == 8
    # The gradients' reduction across the 2 slices: each chip sends about its fsdp-free share of
    # them once (a ring over 2), float32, under the whole gradient's bytes.
    job = build(p.cfg, build_mesh(p.cfg.mesh, target.devices), data=False)
    grads = 4 * sum(x.size for x in jax.tree.leaves(job.setup.fns.abstract_params))
    assert 0 < p.dcn <= grads
    assert p.times["dcn"] == pytest.approx(p.dcn / target.chip.dcn_bandwidth)
    assert "dcn " in report.report(p) and report.as_json(p)["slices"] == 2
    with pytest.raises(MeshError, match="lie on 2 TPU slices"):
        plan.plan(load_config(None, SMALL), target)
