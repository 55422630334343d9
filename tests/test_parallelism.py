"""Each mesh axis compiles to the parallelism it names, read from the optimized HLO of the train step.

The model's global batch (16) and sequence length (40) equal no weight dimension, so a
collective with a dimension that is a multiple of the sequence length carries activations.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from podtrain.config.parallel import MeshConfig
from podtrain.planning import targets
from podtrain.planning.hlo import collectives, summary
from podtrain.program.load import load_config
from podtrain.program.prepare import prepare
from podtrain.program.state import model_fns
from podtrain.runtime.mesh import build_mesh
from podtrain.sharding import sharded_jit

from helpers import LANGUAGE_FAMILIES, needs_libtpu

SEQ, BATCH, D_MODEL, LAYERS = 40, 16, 128, 2
# Eight query heads on two k/v heads: on tensor=8 the k/v heads are repeated.
MODEL = [
    f"model.d_model={D_MODEL}",
    f"model.n_layers={LAYERS}",
    "model.n_heads=8",
    "model.n_kv_heads=2",
    "model.d_ff=256",
    "model.max_seq_len=64",
    f"train.seq_len={SEQ}",
    f"train.batch_size={BATCH}",
    "model.tie_embeddings=false",
    "model.compute_dtype=float32",
    "device_type=cpu",
]


def _config(shape, model="llama"):
    return load_config(
        None, MODEL + [f"model.name={model}"] + [f"mesh.{a}={s}" for a, s in zip(("data", "fsdp", "tensor"), shape)]
    )


@pytest.fixture(scope="module")
def compiled():
    cache = {}

    def get(shape, model="llama"):
        if (shape, model) not in cache:
            cfg = _config(shape, model)
            mesh = build_mesh(cfg.mesh, jax.devices()[: math.prod(shape)])
            cache[shape, model] = prepare(cfg, "cpu", mesh, float("inf"), data=False).compiled
        return cache[shape, model]

    return get


def sizes(model):
    """Bytes of all float32 params, and of those in the layer stack."""
    cfg = _config((1, 1, 1), model)
    fns = model_fns(cfg, build_mesh(cfg.mesh, jax.devices()[:1]))
    layers = sum(4 * s.size for s in jax.tree.leaves(fns.abstract_params["layers"]))
    return 4 * fns.n_params, layers


def arrays(found):
    """(collective, shape) for every array each collective moves."""
    return [(c, shape) for c in found for shape in c.shapes if shape]


def carries_activation(shape) -> bool:
    return any(d % SEQ == 0 for d in shape)


def test_data_parallel_only_reduces_gradients(compiled):
    found = collectives(compiled((8, 1, 1)).as_text())
    assert not [s for _, s in arrays(found) if carries_activation(s)]
    totals = summary(found)
    assert totals["all-gather"] == totals["reduce-scatter"] == totals["all-to-all"] == 0
    assert totals["all-reduce"] == pytest.approx(sizes("llama")[0], rel=0.1)


@pytest.mark.parametrize("model", LANGUAGE_FAMILIES)
def test_fsdp_gathers_each_layer_and_reduces_its_gradient(compiled, model):
    param_bytes, layer_bytes = sizes(model)
    found = collectives(compiled((1, 8, 1), model).as_text())
    assert not [s for _, s in arrays(found) if carries_activation(s)]
    totals = summary(found)
    # ZeRO-3: every layer's weights are gathered in the forward and again in the backward scan,
    # the weights outside the stack once; each gradient is reduced once.
    assert totals["all-gather"] == pytest.approx(2 * layer_bytes + (param_bytes - layer_bytes), rel=0.1)
    assert totals["reduce-scatter"] + totals["all-reduce"] == pytest.approx(param_bytes, rel=0.1)
    in_scan = [c for c in found if c.kind == "all-gather" and c.count == LAYERS]
    assert sum(c.total_bytes for c in in_scan) == pytest.approx(2 * layer_bytes, rel=0.05)  # gathered layer by layer


@pytest.mark.parametrize(
    "shape,model", [((1, 1, 8), "llama"), ((2, 2, 2), "llama"), ((2, 2, 2), "mhc")], ids=["1x1x8", "2x2x2", "2x2x2-mhc"]
)
def test_tensor_parallel_is_megatron_on_the_local_batch(compiled, shape, model):
    data, fsdp, tensor = shape
    local_batch = BATCH // (data * fsdp)
    found = collectives(compiled(shape, model).as_text())
    activations = [(c, s) for c, s in arrays(found) if carries_activation(s)]
    assert activations
    for c, s in activations:
        assert c.kind == "all-reduce" and c.group_size == tensor, (c, s)
        tokens = math.prod(s[: next(i for i, d in enumerate(s) if d % SEQ == 0) + 1])
        assert tokens == local_batch * SEQ, f"{c.kind} of {s} carries more than the local batch of {local_batch}"
    # Per layer: one all-reduce after attention and one after the MLP, forward and backward.
    in_layers = [s for c, s in activations if c.count == LAYERS]
    assert in_layers == [(local_batch, SEQ, D_MODEL)] * 4


def test_fsdp_divides_state_and_activation_memory(compiled):
    one, fsdp = compiled((1, 1, 1)).memory_analysis(), compiled((1, 8, 1)).memory_analysis()
    assert one.argument_size_in_bytes / fsdp.argument_size_in_bytes >= 6
    assert one.temp_size_in_bytes / fsdp.temp_size_in_bytes >= 4


def test_rules_shard_params_and_activations():
    cfg = _config((2, 2, 2))
    mesh = build_mesh(cfg.mesh, jax.devices())
    fns = model_fns(cfg, mesh)
    layers = fns.abstract_params["layers"]
    # The stacked layers' axis is on `stage` (of 1 device here: the pipeline's stages).
    assert layers["attn"]["wq"].sharding.spec == PartitionSpec("stage", "fsdp", "tensor", None)
    assert layers["mlp"]["w_down"].sharding.spec == PartitionSpec("stage", "tensor", "fsdp")
    assert fns.abstract_params["embed"].sharding.spec == PartitionSpec("tensor", "fsdp")
    tokens = jax.ShapeDtypeStruct((BATCH, SEQ), np.int32)
    logits = sharded_jit(fns.apply, mesh).lower(fns.abstract_params, tokens).compile().output_shardings
    assert logits.spec == PartitionSpec(("data", "fsdp"), None, "tensor")


HLO = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}

%body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %ag = f32[32,8]{1,0} all-gather(f32[4,8]{1,0} %x), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}
  %rs = f32[4,8]{1,0} reduce-scatter(f32[32,8]{1,0} %ag), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, to_apply=%add
  ROOT %t = (s32[], f32[4,8]) tuple(%i, %rs)
}

%cond (p: (s32[], f32[4,8])) -> pred[] {
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: f32[4,8]) -> f32[4,8] {
  %w = (s32[], f32[4,8]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %ar = (f32[16,2]{1,0}, bf16[8]{0}) all-reduce(%a, %b), replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, to_apply=%add
  ROOT %r = f32[4,8] get-tuple-element(%w), index=1
}
"""


def test_collectives_are_read_with_their_trip_counts():
    found = {c.kind: c for c in collectives(HLO)}
    assert set(found) == {"all-gather", "reduce-scatter", "all-reduce"}
    assert (found["all-gather"].count, found["all-gather"].bytes, found["all-gather"].group_size) == (3, 32 * 8 * 4, 8)
    assert (found["reduce-scatter"].bytes, found["reduce-scatter"].total_bytes) == (32 * 8 * 4, 3 * 32 * 8 * 4)
    assert found["all-reduce"].shapes == ((16, 2), (8,)) and found["all-reduce"].bytes == 16 * 2 * 4 + 8 * 2
    assert (found["all-reduce"].count, found["all-reduce"].group_size) == (1, 4)
    assert summary(collectives(HLO))["all-gather"] == 3 * 32 * 8 * 4


@needs_libtpu
def test_on_tpu_fsdp_gathers_a_weight_whole_before_its_matmul():
    """A 3B layer's MLP matmul, fsdp-sharded over a v6e-8 on the contracted dimension: the TPU
    compiler's default is a windowed einsum (the weight's shards passed round in a loop, each
    partial product added to the whole output); compiled by `sharded_jit`, one all-gather."""
    mesh = build_mesh(MeshConfig(data=1, fsdp=8), targets.target("v6e-8").devices)
    rows = NamedSharding(mesh, PartitionSpec("fsdp"))
    x = jax.ShapeDtypeStruct((16, 2048, 3072), jnp.bfloat16, sharding=rows)
    w = jax.ShapeDtypeStruct((3072, 16384), jnp.bfloat16, sharding=rows)

    def moved(jitted):
        return {k: v for k, v in summary(collectives(jitted.lower(x, w).compile().as_text())).items() if v}

    assert set(moved(jax.jit(jnp.matmul, out_shardings=rows))) == {"collective-permute"}
    assert moved(sharded_jit(jnp.matmul, mesh, out_shardings=rows)) == {"all-gather": 3072 * 16384 * 2}
