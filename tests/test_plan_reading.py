"""Reading a plan: `plan --top N` (the compiled step's operations that move the most bytes and do
the most FLOPs, each traced back to its model code), and GPU plans compiled with cuDNN's attention."""

import re

import pytest
from podtrain.planning import cost, hlo, plan, report
from podtrain.planning import targets as hardware
from podtrain.program.checks import changed
from podtrain.program.job import build
from podtrain.program.load import load_config
from podtrain.runtime.mesh import build_mesh

from helpers import SMALL


def test_operations_add_up_to_the_step_and_name_their_source():
    cfg = load_config(None, SMALL + ["mesh.data=1", "model.remat=full", "train.grad_accum=2"])
    target = hardware.target("cpu:1")
    p = plan.plan(cfg, target)
    text = plan.prepared(cfg, target).compiled.as_text()
    ops = cost.operations(text)
    assert sum(o.bytes for o in ops) == cost.memory_traffic(text) == p.traffic
    assert sum(o.flops for o in ops) == cost.matmul_flops(text) == p.matmul_flops
    assert p.top_bytes and p.top_flops
    for ranking, key in ((p.top_bytes, "bytes"), (p.top_flops, "flops")):
        amounts = [getattr(o, key) for o in ranking]
        assert amounts == sorted(amounts, reverse=True) and amounts[0] == max(getattr(o, key) for o in ops)
    # Every matmul comes from a model or loss file of podtrain, by its line.
    for o in p.top_flops:
        assert re.fullmatch(r"(xla|module|layers|llama|language)\.py:\d+", o.source), o
    assert all(o.flops > 0 for o in p.top_flops)

    # What `plan --top 3` prints: three rows of each ranking, with shares and sources.
    out = report.report(p, top=3)
    bytes_rows = out.split("top bytes")[1].split("top flops")[0].strip().splitlines()[1:]
    flops_rows = out.split("top flops")[1].strip().splitlines()[1:]
    assert len(bytes_rows) == 3 and len(flops_rows) == 3
    for row, o in zip(bytes_rows + flops_rows, p.top_bytes[:3] + p.top_flops[:3]):
        assert row.split()[0].endswith("%") and o.source in row and row.endswith(o.name), row
    assert [op["name"] for op in report.as_json(p, top=2)["top_flops"]] == [o.name for o in p.top_flops[:2]]


def test_one_branch_of_a_conditional_runs_and_each_counts_its_share():
    """jax.lax.cond between one matmul and two: the plan counts each branch half the time, 1.5
    matmuls, in FLOPs and in the bytes each of its operations moves."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((64, 64))
    text = (
        jax.jit(lambda p, x: jax.lax.cond(p, lambda x: x @ x, lambda x: x @ x @ x, x))
        .lower(True, x)
        .compile()
        .as_text()
    )
    assert "conditional(" in text
    assert cost.matmul_flops(text) == 1.5 * 2 * 64**3
    matmuls = [o for o in cost.operations(text) if o.flops]
    assert len(matmuls) == 3 and all(o.flops == 2 * 64**3 / 2 for o in matmuls), matmuls
    # x @ x reads one 64 x 64 array and writes one; (x @ x) @ x reads two
    assert sorted(o.bytes for o in matmuls) == [64 * 64 * 4 * n / 2 for n in (2, 2, 3)], matmuls


def _score_arrays(hlo_text: str, seq: int, block: int) -> list[str]:
    """Arrays of the HLO with two sequence-sized dimensions: attention scores (seq or a causal block of queries)."""
    arrays = re.findall(r"\[([\d,]+)\]", hlo_text)
    return [a for a in arrays if sum(int(d) in (seq, block) for d in a.split(",")) >= 2]


@pytest.mark.integration
def test_a_gpu_plan_compiles_cudnn_attention_without_scores():
    """A GPU plan compiles for the card with no GPU here: attention is cuDNN's fused kernel (a
    custom call, partitioned per shard over a mesh), so no (seq, seq) scores appear."""
    overrides = [o for o in SMALL if "compute_dtype" not in o] + ["model.compute_dtype=bfloat16"]
    cfg = load_config(None, overrides + ["train.seq_len=96", "model.max_seq_len=96", "mesh.data=2", "mesh.tensor=2"])
    target = hardware.target("h100x4")
    assert target.label.endswith("(compiled for the GPU)") and target.devices[0].platform == "gpu"
    resolved = plan.prepared(cfg, target).cfg
    assert resolved.model.attention == "cudnn"
    compiled = {}
    for attention in ("xla", "cudnn"):
        c = changed(resolved, {"model.attention": attention})
        compiled[attention] = build(c, build_mesh(c.mesh, target.devices), data=False).compile()
    texts = {k: v.as_text() for k, v in compiled.items()}
    assert _score_arrays(texts["xla"], 96, 48)  # the detector sees XLA's scores (2 causal blocks of 48)
    assert _score_arrays(texts["cudnn"], 96, 48) == []
    assert "__cudnn$fmha" in texts["cudnn"] and "__cudnn$fmha" not in texts["xla"]
    assert texts["cudnn"].count("all-gather") == texts["xla"].count("all-gather") == 0  # per shard
    memory = {k: v.memory_analysis().temp_size_in_bytes for k, v in compiled.items()}
    assert memory["cudnn"] < memory["xla"]


UPDATE_IN_BF16 = """HloModule m

%fused (param_0: s32[], param_1: bf16[4,8,16], param_2: bf16[8,16]) -> bf16[4,8,16] {
  %param_1 = bf16[4,8,16]{2,1,0} parameter(1)
  %convert.1 = f32[4,8,16]{2,1,0} convert(%param_1)
  %param_2 = bf16[8,16]{1,0} parameter(2)
  %convert.2 = f32[8,16]{1,0} convert(%param_2)
  %bitcast = f32[1,8,16]{2,1,0} bitcast(%convert.2)
  %param_0 = s32[] parameter(0)
  %zero = s32[] constant(0)
  %dus = f32[4,8,16]{2,1,0} dynamic-update-slice(%convert.1, %bitcast, %param_0, %zero, %zero)
  ROOT %convert.3 = bf16[4,8,16]{2,1,0} convert(%dus)
}

ENTRY %main (i: s32[], buffer: bf16[4,8,16], row: bf16[8,16]) -> bf16[4,8,16] {
  %i = s32[] parameter(0)
  %buffer = bf16[4,8,16]{2,1,0} parameter(1)
  %row = bf16[8,16]{1,0} parameter(2)
  ROOT %f = bf16[4,8,16]{2,1,0} fusion(%i, %buffer, %row), kind=kLoop, calls=%fused
}
"""


def test_a_bf16_update_the_cpu_wraps_in_converts_moves_the_whole_buffer():
    """The CPU compiler updates a bf16 buffer by converting it whole to f32 and back: read whole,
    written whole (a GPU plan compiles for the GPU, which writes the row in place)."""
    buffer, row = 4 * 8 * 16 * 2, 8 * 16 * 2
    assert cost.memory_traffic(UPDATE_IN_BF16) == 4 + 2 * buffer + row


ON_CHIP_AND_IN_PLACE = """HloModule m

%update (p0: f32[4,8], p1: f32[4,8], p2: f32[8], p3: s32[]) -> (f32[4,8], f32[4,8]) {
  %p0 = f32[4,8]{1,0} parameter(0)
  %p2 = f32[8]{0:S(1)} parameter(2)
  %b = f32[1,8]{1,0} bitcast(%p2)
  %p3 = s32[] parameter(3)
  %zero = s32[] constant(0)
  %d0 = f32[4,8]{1,0} dynamic-update-slice(%p0, %b, %p3, %zero)
  %p1 = f32[4,8]{1,0} parameter(1)
  %d1 = f32[4,8]{1,0} dynamic-update-slice(%p1, %b, %p3, %zero)
  ROOT %t = (f32[4,8]{1,0}, f32[4,8]{1,0}) tuple(%d0, %d1)
}

%row (q0: f32[4,8], q1: s32[]) -> f32[1,8] {
  %q0 = f32[4,8]{1,0} parameter(0)
  %q1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  ROOT %s = f32[1,8]{1,0} dynamic-slice(%q0, %q1, %zero), dynamic_slice_sizes={1,8}
}

%reads_a_row (r0: f32[4,8], r1: s32[]) -> f32[1,8] {
  %r0 = f32[4,8]{1,0} parameter(0)
  %r1 = s32[] parameter(1)
  %inner = f32[1,8]{1,0} fusion(%r0, %r1), kind=kLoop, calls=%row
  ROOT %n = f32[1,8]{1,0} negate(%inner)
}

ENTRY %main (a: f32[4,8], b: f32[4,8], v: f32[8], i: s32[], w: f32[64]) -> f32[1,8] {
  %a = f32[4,8]{1,0} parameter(0)
  %b = f32[4,8]{1,0} parameter(1)
  %v = f32[8]{0} parameter(2)
  %i = s32[] parameter(3)
  %w = f32[64]{0} parameter(4)
  %pre = (f32[8]{0:S(1)}, f32[8]{0}, u32[]{:S(2)}) copy-start(%v)
  %on_chip = f32[8]{0:S(1)} copy-done(%pre)
  %fresh = f32[4,8]{1,0} custom-call(), custom_call_target="AllocateBuffer"
  %u = (f32[4,8]{1,0}, f32[4,8]{1,0}) fusion(%a, %fresh, %on_chip, %i), kind=kLoop, calls=%update
  %ss = ((f32[64]{0}), f32[16]{0:S(1)}, s32[]{:S(2)}) slice-start(%w), slice={[0:16]}
  %sd = f32[16]{0:S(1)} slice-done(%ss)
  ROOT %r = f32[1,8]{1,0} fusion(%a, %i), kind=kLoop, calls=%reads_a_row
}
"""


def test_device_memory_traffic_leaves_out_what_stays_on_chip_or_in_place():
    """What a TPU program moves through HBM: a prefetch to on-chip memory (S(1)) reads its source
    once and its done moves nothing; an asynchronous slice reads its slice; a fusion updating two
    buffers in place, one only reserved (AllocateBuffer, as for a scan's stacked outputs), writes
    two rows and reads an on-chip operand for free; a fusion whose nested fusion slices a buffer
    reads one row of it."""
    moved = {o.name: o.bytes for o in cost.operations(ON_CHIP_AND_IN_PLACE)}
    row = 8 * 4
    assert moved == {"pre": 8 * 4, "u": 4 + 2 * row, "ss": 16 * 4, "r": row + 4 + row}


# A windowed einsum as the TPU compiler writes one (an fsdp all-gather overlapped with its matmul):
# a loop whose u32 counter starts at a copy of 0 and steps by 2 up to 4, one matmul and one shard
# passed on (with the TPU's two u32 contexts) per iteration, and a fusion whose sixth operand the
# text numbers (/*index=5*/).
WINDOWED = """HloModule m

%cond (p: (u32[], f32[8,8])) -> pred[] {
  %p = (u32[], f32[8,8]) parameter(0)
  %i = u32[]{:T(128)} get-tuple-element(%p), index=0
  %n = u32[]{:T(128)} constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p: (u32[], f32[8,8])) -> (u32[], f32[8,8]) {
  %p = (u32[], f32[8,8]) parameter(0)
  %i = u32[]{:T(128)} get-tuple-element(%p), index=0
  %x = f32[8,8]{1,0} get-tuple-element(%p), index=1
  %y = f32[8,8]{1,0} dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %cp = (f32[8,8], f32[8,8], u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%x), source_target_pairs={{0,1}}
  %cd = f32[8,8]{1,0} collective-permute-done(%cp)
  %two = u32[]{:T(128)} constant(2)
  %next = u32[]{:T(128)} add(%i, %two)
  ROOT %t = (u32[], f32[8,8]) tuple(%next, %y)
}

%six (a: f32[8], b: f32[8], c: f32[8], d: f32[8], e: f32[8], f: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %f = f32[8]{0} parameter(5)
  ROOT %s = f32[8]{0} add(%a, %f)
}

ENTRY %main (x: f32[8,8], v: f32[8]) -> f32[8] {
  %x = f32[8,8]{1,0} parameter(0)
  %v = f32[8]{0} parameter(1)
  %zero = u32[]{:T(128)} constant(0)
  %start = u32[]{:T(128)} copy(%zero)
  %init = (u32[], f32[8,8]) tuple(%start, %x)
  %w = (u32[], f32[8,8]) while(%init), condition=%cond, body=%body
  ROOT %r = f32[8]{0} fusion(%v, %v, %v, %v, %v, /*index=5*/%v), kind=kLoop, calls=%six
}
"""


def test_a_windowed_einsum_loop_counts_its_iterations_and_numbered_operands_count():
    """The loop runs twice (counter 0, 2 < 4), so its matmul and its permute count twice, the
    permute as the shard it sends; the fusion reads all six operands, the numbered one too."""
    assert cost.matmul_flops(WINDOWED) == 2 * 2 * 8 * 8 * 8
    (permute,) = hlo.collectives(WINDOWED)
    assert (permute.kind, permute.count, permute.bytes) == ("collective-permute", 2, 8 * 8 * 4)
    moved = {o.name: o.bytes for o in cost.operations(WINDOWED)}
    assert moved["y"] == 2 * 3 * 8 * 8 * 4 and moved["r"] == 7 * 8 * 4


# The TPU's reduce-scatter of a gradient: a fusion whose computation all-reduces and returns this
# device's slice (the ring moves each slice once, as a reduce-scatter does), beside a plain
# all-reduce whose result the program slices later.
ALL_REDUCE_SCATTER = """HloModule m

%add (a: bf16[], b: bf16[]) -> bf16[] {
  ROOT %s = bf16[] add(%a, %b)
}

%all-reduce-scatter (input: bf16[64,8]) -> bf16[8,8] {
  %input = bf16[64,8]{1,0} parameter(0)
  %ar = bf16[64,8]{1,0} all-reduce(%input), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %offset = s32[] parameter(1)
  %zero = s32[] constant(0)
  ROOT %slice = bf16[8,8]{1,0} dynamic-slice(%ar, %offset, %zero), dynamic_slice_sizes={8,8}
}

ENTRY %main (g: bf16[64,8], h: bf16[64,8], i: s32[]) -> (bf16[8,8], bf16[64,8]) {
  %g = bf16[64,8]{1,0} parameter(0)
  %h = bf16[64,8]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %rs = bf16[8,8]{1,0} fusion(%g, %i), kind=kCustom, calls=%all-reduce-scatter
  %full = bf16[64,8]{1,0} all-reduce(%h), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  ROOT %t = (bf16[8,8], bf16[64,8]) tuple(%rs, %full)
}
"""


def test_an_all_reduce_the_tpu_fuses_with_its_slice_counts_as_a_reduce_scatter():
    totals = hlo.summary(hlo.collectives(ALL_REDUCE_SCATTER))
    assert totals["reduce-scatter"] == totals["all-reduce"] == 64 * 8 * 2


RAGGED_AND_KERNEL = """HloModule m

ENTRY %main (x: bf16[64,8], room: bf16[256,8], o: s32[4], s: s32[4], w: bf16[2,8,16]) -> bf16[256,16] {
  %x = bf16[64,8]{1,0} parameter(0)
  %room = bf16[256,8]{1,0} parameter(1)
  %o = s32[4]{0} parameter(2)
  %s = s32[4]{0} parameter(3)
  %w = bf16[2,8,16]{2,1,0} parameter(4)
  %there = bf16[256,8]{1,0} ragged-all-to-all(%x, %room, %o, %s, %o, /*index=5*/%s), replica_groups={{0,1,2,3}}
  ROOT %gmm = bf16[256,16]{1,0} custom-call(%there, %w, %s), custom_call_target="tpu_custom_call", KERNEL
}
""".replace(
    "KERNEL",
    'metadata={op_name="jit(step)/shard_map/expert_rows_64_of_256/jit(gmm)/pallas_call"}, backend_config='
    '{"custom_call_config": {"cost_estimate":{"flops":"65536","transcendentals":"0","bytes_accessed":"12288"}}}',
)


RAGGED_ON_A_GPU = """HloModule m

ENTRY %main (x: f32[64,8], room: f32[256,8], o: s64[4], s: s64[4]) -> f32[64,8] {
  %x = f32[64,8]{1,0} parameter(0)
  %room = f32[256,8]{1,0} parameter(1)
  %o = s64[4]{0} parameter(2)
  %s = s64[4]{0} parameter(3)
  %go = ((f32[64,8]{1,0}, f32[256,8]{1,0}, OFFSETS), f32[256,8]{1,0}) ragged-all-to-all-start(%x, %room, SENT
  %there = f32[256,8]{1,0} ragged-all-to-all-done(%go)
  %back = ((f32[256,8]{1,0}, f32[64,8]{1,0}, OFFSETS), f32[64,8]{1,0}) ragged-all-to-all-start(%there, %x, SENT
  ROOT %home = f32[64,8]{1,0} ragged-all-to-all-done(%back)
}
""".replace("OFFSETS", "s64[4]{0}, s64[4]{0}, s64[4]{0}, /*index=5*/s64[4]{0}").replace(
    "SENT", "%o, %s, %o, /*index=5*/%s), replica_groups={{0,1,2,3}}"
)


def test_the_gpus_asynchronous_ragged_all_to_all_moves_its_rows_each_way():
    """The GPU's ragged-all-to-all-start holds its operands beside its output: out to a room of 256
    and back from it, each counts the 64 rows sent, on the network and in device memory (read
    from the compiled step, Mixtral's shape on H100 x 8 read 2.5x the copies before)."""
    found = hlo.collectives(RAGGED_ON_A_GPU)
    assert [c.bytes for c in found] == [64 * 8 * 4] * 2
    starts = [o for o in cost.operations(RAGGED_ON_A_GPU) if o.op == "ragged-all-to-all-start"]
    assert [o.bytes for o in starts] == [2 * 64 * 8 * 4] * 2


def test_a_ragged_all_to_all_moves_its_rows_and_a_grouped_matmul_costs_the_rows_it_runs():
    """A ragged all-to-all counts the rows it sends (64), not the receiver's room for 256, on the
    network and in device memory; a
    grouped matmul given 256 rows of which a balanced routing fills 64 counts a quarter of the
    FLOPs and bytes its kernel declares."""
    (found,) = hlo.collectives(RAGGED_AND_KERNEL)
    assert found.kind == "ragged-all-to-all" and found.bytes == 64 * 8 * 2
    ops = {o.op: o for o in cost.operations(RAGGED_AND_KERNEL)}
    assert (ops["custom-call"].flops, ops["custom-call"].bytes) == (65536 // 4, 12288 // 4)
    assert ops["ragged-all-to-all"].bytes == 2 * 64 * 8 * 2  # the rows it reads and writes
