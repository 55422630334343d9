"""Pipeline parallelism over mesh.stage, GPipe and circular: the layers cut into stages on their
own devices, the batch into microbatches. The same losses and weights as one device; each
device computes only its stage's layers; the hand-offs are collective permutes along `stage`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from podtrain.errors import ConfigError
from podtrain.models import build_model
from podtrain.planning import cost, hlo, plan, report
from podtrain.planning import targets as hardware
from podtrain.program.job import accumulation, build
from podtrain.program.load import load_config
from podtrain.runtime.mesh import build_mesh
from podtrain.sharding import sharded_jit
from podtrain.train.checkpoint import Checkpointer
from podtrain.train.loop import train

from helpers import SMALL, run_steps, trainer

LLAMA = SMALL + ["model.n_layers=4"]
LLAMA8 = SMALL + ["model.n_layers=8"]
MHC = LLAMA + ["model.name=mhc", "model.streams=4"]
CIRCULAR = ["pipeline.schedule=circular", "pipeline.repeats=2"]
# Dropless routing with every report in use: the balancing and z losses, the bias update's loads.
MOE_ARGS = ["model.name=moe", "model.experts=4", "model.experts_per_token=2", "model.expert_d_ff=32"]
MOE = [*LLAMA, *MOE_ARGS, "model.router_z_loss_coef=0.001", "model.router_bias_update_rate=0.01"]
ONE_DEVICE = {}


def _one_device(base: list[str]):
    key = tuple(base)
    if key not in ONE_DEVICE:
        ONE_DEVICE[key] = run_steps([*base, "mesh.data=1"], n_devices=1, n_steps=2)
    return ONE_DEVICE[key]


@pytest.mark.parametrize(
    "base,mesh,devices",
    [
        (LLAMA, ["mesh.stage=2", "mesh.data=1"], 2),
        (LLAMA, ["mesh.stage=4", "mesh.data=2", "pipeline.microbatches=8"], 8),
        (LLAMA, ["mesh.stage=2", "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2"], 8),
        (MHC, ["mesh.stage=2", "mesh.data=2"], 4),
        (LLAMA, ["mesh.stage=2", "mesh.data=1", *CIRCULAR, "pipeline.microbatches=4"], 2),
        (LLAMA8, ["mesh.stage=4", "mesh.data=2", *CIRCULAR], 8),
        (MHC, ["mesh.stage=2", "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2", *CIRCULAR], 8),
        ([*LLAMA, *MOE_ARGS, "model.first_dense_layers=2"], ["mesh.stage=2", "mesh.data=1"], 2),
        ([*LLAMA, *MOE_ARGS], ["mesh.stage=2", "mesh.data=1", "mesh.expert=2"], 4),
    ],
    ids=[
        "llama-stage2",
        "llama-stage4-data2-8micro",
        "llama-stage2-fsdp2-tensor2",
        "mhc-stage2-data2",
        "llama-stage2-circular2-4micro",
        "llama-stage4-circular2-data2",
        "mhc-stage2-circular2-fsdp2-tensor2",
        "moe-dense2-stage2",  # two stacks, each a pipeline
        "moe-stage2-expert2",
    ],
)
def test_a_pipeline_trains_like_one_device(base, mesh, devices):
    losses, params = run_steps([*base, *mesh], n_devices=devices, n_steps=2)
    one_losses, one_params = _one_device(base)
    np.testing.assert_allclose(losses, one_losses, rtol=0, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5), params, one_params)


def routed_steps(overrides, devices, n_steps=2):
    """Each step's metrics, for an MoE on the mesh in `overrides`."""
    state, step, batches = trainer(overrides, devices)
    found = []
    for i in range(n_steps):
        state, metrics = step(state, batches[i])
        found.append(jax.device_get(metrics))
    return found


@pytest.mark.parametrize("schedule", [[], [*CIRCULAR, "pipeline.microbatches=4"]], ids=["gpipe", "circular"])
def test_an_moe_pipelines_with_its_layers_routing_reports(schedule):
    """Each MoE layer reports its routing statistics, means over its batch's tokens; pipelined,
    a layer's reports are the mean of its microbatches', so the loss (balancing and z terms in
    it), the loads per layer and the router bias they move equal one device's."""
    one = routed_steps([*MOE, "mesh.data=1", *schedule], 1)
    piped = routed_steps([*MOE, "mesh.stage=2", "mesh.data=1", *schedule], 2)
    routing = {"loss", "aux_loss", "z_loss", "expert_load", *(f"expert_load/{i}" for i in range(4))}
    for ours, reference in zip(piped, one):
        assert routing <= set(ours)
        for key in routing:
            np.testing.assert_allclose(ours[key], reference[key], rtol=1e-5, err_msg=key)


def test_each_stage_runs_its_own_layers_and_hands_on_by_permutes():
    def compiled(mesh):
        cfg = load_config(None, [*LLAMA, "model.n_layers=8", "train.batch_size=16", *mesh])
        devices = jax.devices()[: 4 if "mesh.stage=4" in mesh else 1]
        return cfg, build(cfg, build_mesh(cfg.mesh, devices), data=False).compile().as_text()

    _, piped = compiled(["mesh.stage=4", "mesh.data=1"])
    _, whole = compiled(["mesh.data=1"])
    _, circular = compiled(["mesh.stage=4", "mesh.data=1", *CIRCULAR])
    permutes = [c for c in hlo.collectives(piped) if c.kind == "collective-permute"]
    assert permutes and all(hlo.mesh_axes(c, {"data": 1, "stage": 4}) == ("stage",) for c in permutes)
    # A device's matmuls: its 2 of the 8 layers over every microbatch, plus the embedding and
    # head it shares as data parallelism: well under half of one device's whole step.
    assert cost.matmul_flops(piped) < 0.5 * cost.matmul_flops(whole)
    # Circular, 2 laps of pieces of 1 layer: the idle ticks' placeholder work shrinks from (M + S - 1)
    # / M to (R M + S - 1) / (R M) of the layers' (11/14 as much as GPipe's; the head is the same).
    np.testing.assert_allclose(cost.matmul_flops(circular) / cost.matmul_flops(piped), 11 / 14, rtol=0.03)
    # The weights, one layout on every schedule, regrouped into the stages' pieces along `stage`.
    regroups = [c for c in hlo.collectives(circular) if c.kind == "all-to-all"]
    assert regroups and all(hlo.mesh_axes(c, {"data": 1, "stage": 4}) == ("stage",) for c in regroups)
    assert not any(c.kind == "all-to-all" for c in hlo.collectives(piped))


def test_the_plan_reports_the_circular_schedules_smaller_bubble():
    cfg = load_config(None, [*LLAMA8, "mesh.stage=4", "mesh.data=1", *CIRCULAR])
    p = plan.plan(cfg, hardware.target("cpu:4"))
    assert p.bubble == 3 / 11  # (S - 1) / (R M + S - 1), against GPipe's 3 / 7
    assert "4 stages, 4 microbatches, circular, 2 laps: bubble 27.3% of the step" in report.report(p)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["mesh.stage=2", "pipeline.microbatches=1"], "must be at least the 2 stages"),
        (["mesh.stage=4", "model.n_layers=6"], "does not cut evenly into 4 pipeline stages"),
        (["mesh.stage=2", "mesh.context=2"], "pipelines the layers of .* models with mesh.context=1"),
        (["mesh.stage=2", *MOE_ARGS, "model.first_dense_layers=1"], "stacks of 1 and 1 layers"),
        (["mesh.stage=2", "pipeline.microbatches=4", "train.batch_size=6"], "divide the 6 sequences"),
        (
            ["mesh.stage=2", "train.batch_size=12", "train.grad_accum=2", "pipeline.microbatches=4"],
            "divide the 6 sequences .*train.grad_accum=2",
        ),
        (["mesh.stage=2", "pipeline.schedule=circular"], "goes round the stages 2 or more times"),
        (["mesh.stage=2", "pipeline.repeats=2"], "gpipe once"),
        (["mesh.stage=2", *CIRCULAR, "model.n_layers=6"], "2 pipeline stages .* x 2 pipeline.repeats"),
    ],
)
def test_a_pipeline_that_cannot_run_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*SMALL, *overrides])


def test_the_stack_refuses_a_batch_the_microbatches_do_not_divide_and_decodes_whole():
    """Past the config check (a batch it does not see), the stack itself refuses to run a batch
    of 3 as anything but 2 microbatches; decoding, a prompt of batch 1, runs as on one device."""
    cfg = load_config(None, [*LLAMA, "mesh.stage=2", "mesh.data=1"])
    mesh = build_mesh(cfg.mesh, jax.devices()[:2])
    model = build_model(cfg.model, nnx.Rngs(0))
    with pytest.raises(ConfigError, match="pipeline.microbatches=2 does not divide a batch of 3"):
        sharded_jit(lambda t: model.features(t)[1], mesh)(jnp.zeros((3, 16), jnp.int32))
    prompt = jnp.arange(1, 9, dtype=jnp.int32)[None]

    def decode(tokens):
        return model.decode(tokens, model.init_cache(1, 16), jnp.int32(0))[0]

    np.testing.assert_allclose(sharded_jit(decode, mesh)(prompt), jax.jit(decode)(prompt), rtol=0, atol=1e-5)


def test_more_accumulation_on_a_mesh_keeps_the_pipelines_microbatches_whole():
    """train.device_batch may ask for more accumulation on a mesh than the config's: the pipeline's
    microbatches must still split each accumulation microbatch, or the job is refused."""
    cfg = load_config(None, [*SMALL, "train.batch_size=24", "train.device_batch=3"])
    assert accumulation(cfg, 2) == 4 and accumulation(cfg, 2, pipelined=4) == 6  # 6, then 4 sequences
    cfg = load_config(None, [*SMALL, "train.batch_size=24", "train.device_batch=1"])
    assert accumulation(cfg, 2) == 12
    with pytest.raises(ConfigError, match="into pipeline.microbatches=4"):
        accumulation(cfg, 2, pipelined=4)


def test_a_checkpoint_of_stages_over_slices_restores_on_any_mesh(tmp_path):
    """Written with stage=2 x dcn_data=2 (2 slices of 4 devices), the params keep one stacked
    layout on disk: restored on data=8 and on one device they are the same numbers."""
    overrides = [*LLAMA, "mesh.stage=2", "mesh.dcn_data=2", "mesh.data=2", "train.steps=2", f"run_dir={tmp_path}"]
    train(load_config(None, [*overrides, "train.eval_every=0", "train.sample_tokens=0"]))
    restored = []
    for mesh, devices in ((["mesh.data=8"], 8), (["mesh.data=1"], 1)):
        cfg = load_config(None, [*LLAMA, *mesh])
        job = build(cfg, build_mesh(cfg.mesh, jax.devices()[:devices]), data=False)
        checkpointer = Checkpointer(tmp_path / "checkpoints")
        state = checkpointer.restore({"params": job.setup.fns.abstract_params})
        checkpointer.close()
        assert int(state["step"]) == 2
        restored.append(jax.device_get(state["params"]))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), *restored)
    _, trained = run_steps([*LLAMA, "mesh.data=1"], n_devices=1, n_steps=2)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5), restored[1], trained)
