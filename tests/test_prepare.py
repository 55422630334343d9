"""The program layer: a config made final once, and a train step compiled once per start, the very
executable the loop then runs and the fit check read."""

import logging
from pathlib import Path

import jax
import pytest
from podtrain.planning import plan
from podtrain.planning import targets as hardware
from podtrain.program.job import build
from podtrain.program.load import load_config
from podtrain.program.prepare import final, prepare
from podtrain.runtime.mesh import build_mesh
from podtrain.train import loop

from helpers import needs_cuda_compiler

CONFIGS = Path(__file__).parent.parent / "configs"
TINY = ["model.n_layers=2", "model.d_model=64", "model.n_heads=2", "model.n_kv_heads=2", "model.d_ff=128"]


def train_step_compiles(records) -> int:
    return sum(r.getMessage().startswith("Finished XLA compilation of jit(train_step)") for r in records)


@pytest.fixture
def compiles(caplog):
    """The log records of this test's compiles (jax_log_compiles)."""
    jax.config.update("jax_log_compiles", True)
    caplog.set_level(logging.WARNING, logger="jax")
    yield caplog
    jax.config.update("jax_log_compiles", False)


def test_train_compiles_its_step_once_and_runs_that_executable(tmp_path, compiles, monkeypatch):
    ran = []

    class Recording(loop.Trainer):
        def __init__(self, step, *args):
            ran.append(step)
            super().__init__(step, *args)

    monkeypatch.setattr(loop, "Trainer", Recording)
    cfg = load_config(
        CONFIGS / "tiny.yaml",
        [*TINY, "train.steps=2", "train.eval_every=0", "train.sample_tokens=0", "compile_cache=off"]
        + ["mesh.data=2", "mesh.fsdp=4", f"run_dir={tmp_path / 'run'}"],
    )
    loop.train(cfg)
    assert train_step_compiles(compiles.records) == 1
    assert isinstance(ran[0], jax.stages.Compiled)  # the fit check's compile, not a jit that compiles again


def test_the_config_is_made_final_once_for_the_mesh():
    """train.grad_accum for the mesh is part of the final config the job is built from, and `build`
    refuses a config not made final: the job's config is the loop's."""
    cfg = load_config(None, [*TINY, "train.batch_size=16", "train.device_batch=1", "mesh.data=8", "mesh.fsdp=1"])
    mesh = build_mesh(cfg.mesh, jax.devices())
    done = final(cfg, "cpu", mesh)
    assert (done.train.grad_accum, done.model.compute_dtype, done.model.scan_unroll) == (2, "float32", 1)
    ready = prepare(cfg, "cpu", mesh, float("inf"), data=False)
    assert ready.cfg == done and ready.job.task.train_batch.shape[:2] == (2, 8)
    with pytest.raises(ValueError, match="made final"):
        build(cfg, mesh, data=False)


@needs_cuda_compiler
def test_a_gpu_step_whose_unroll_is_settled_by_its_memory_compiles_once(compiles):
    """`scan_unroll=auto` on a GPU: the unrolled step, compiled to read its memory, is the step kept."""
    cfg = load_config(CONFIGS / "tiny.yaml", [*TINY, "model.scan_unroll=auto", "train.batch_size=4"])
    ready = plan.prepared(cfg, hardware.target("h100"))
    assert ready.cfg.model.scan_unroll == 2 and ready.compiled is not None
    assert train_step_compiles(compiles.records) == 1
