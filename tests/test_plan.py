"""`podtrain plan`: its memory against a real run's, its collectives against the analytic volume,
its FLOP count against the model's formula, TPU targets through libtpu, and the exit codes."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from podtrain.axes import AXES
from podtrain.errors import DoesNotFit
from podtrain.models.attention import causal_blocks
from podtrain.planning import fit, plan, report
from podtrain.planning import targets as hardware
from podtrain.program.checks import changed
from podtrain.program.job import build
from podtrain.program.load import load_config
from podtrain.program.state import model_fns
from podtrain.runtime import chips
from podtrain.runtime.mesh import build_mesh, factorizations
from podtrain.train import loop
from podtrain.train.loop import train

from helpers import NOISE, needs_cuda_compiler, needs_libtpu

CONFIGS = Path(__file__).parent.parent / "configs"
# A Llama big enough that its arrays, not the runtime, make up a step's memory.
MEDIUM = [
    "model.d_model=256",
    "model.n_layers=4",
    "model.n_heads=8",
    "model.n_kv_heads=4",
    "model.d_ff=768",
    "train.batch_size=16",
    "device_type=cpu",
]


def cpu(n: int) -> hardware.Target:
    return hardware.target(f"cpu:{n}")


def _rss() -> tuple[int, int]:
    """(resident bytes now, peak since the last reset) of this process."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


@pytest.mark.integration
def test_memory_is_within_2x_of_a_real_step(tmp_path):
    """The plan's bytes per device x 4 devices against the growth of this process's peak resident
    memory while the state is made and a step runs over it, donated (all 4 fake devices live in
    this process; the step is compiled before the peak is reset, so the compiler's own memory is
    left out). The peak is the first step's: 3 steps measured within 2% of it."""
    cfg = load_config(CONFIGS / "tiny.yaml", [*MEDIUM, f"run_dir={tmp_path}"])
    predicted = plan.plan(cfg, cpu(4))
    job = build(predicted.cfg, build_mesh(cfg.mesh, jax.devices()[:4]))
    job.compile()
    batch = jax.device_put(jax.numpy.zeros(job.task.train_batch.shape, jax.numpy.int32), job.task.train_batch.sharding)
    Path("/proc/self/clear_refs").write_text("5")  # resets the peak (VmHWM) to the current RSS
    before, _ = _rss()
    state = job.init_state(0)
    state, metrics = job.step(state, batch)
    jax.block_until_ready(state)
    measured = _rss()[1] - before
    assert predicted.fits and predicted.memory.temporaries > 0
    assert measured / 2 <= 4 * predicted.memory.total <= 2 * measured, (measured, predicted.memory)


def _sizes(cfg):
    fns = model_fns(cfg, build_mesh(cfg.mesh, jax.devices()[:1]))
    return 4 * fns.n_params, sum(4 * s.size for s in jax.tree.leaves(fns.abstract_params["layers"]))


def test_fsdp_collectives_are_the_analytic_volume():
    """ZeRO-3 on fsdp=8: each layer's float32 weights gathered in the forward and again in the
    backward, the rest once; every gradient reduce-scattered once (bytes of the whole arrays)."""
    cfg = load_config(CONFIGS / "tiny.yaml", [*MEDIUM, "mesh.data=1", "mesh.fsdp=8", "model.tie_embeddings=false"])
    p = plan.plan(cfg, cpu(8))
    params, layers = _sizes(changed(p.cfg, {"mesh.fsdp": 1}))
    assert p.collectives["all-gather"] == pytest.approx(2 * layers + (params - layers), rel=0.1)
    assert p.collectives["reduce-scatter"] + p.collectives["all-reduce"] == pytest.approx(params, rel=0.1)
    assert p.times["network"] > 0 and p.step_time == max(p.times["compute"], p.times["memory"], p.times["network"])


@pytest.mark.parametrize("remat,lora", [("none", 0), ("full", 0), ("none", 8)])
def test_compiled_matmul_flops_match_the_model(remat, lora):
    """Counted in the HLO with each scanned layer once per layer: the model's 6N + 12LdT (T the
    keys a query sees, (T + 1) / 2 causally; within the embedding lookup, which is no matmul),
    plus the masked scores that causal blocks still compute; more under full remat, whose
    forward runs twice. Under LoRA 4 per frozen weight (no gradient of its own) and 6 per adapter's."""
    overrides = [f"model.remat={remat}", "model.tie_embeddings=false"]
    lora_keys = [f"train.lora.rank={lora}", "train.init_from=a_base"] if lora else []
    cfg = load_config(CONFIGS / "tiny.yaml", [*MEDIUM, *overrides, *lora_keys])
    p = plan.plan(cfg, cpu(8))
    m, t = p.cfg.model, p.cfg.train.seq_len
    blocks = causal_blocks(t)
    masked = 12 * m.n_layers * m.d_model * ((blocks + 1) / (2 * blocks) * t - (t + 1) / 2) * p.tokens_per_step
    counted = p.matmul_flops * 8 / (p.flops_per_step + masked)
    if remat == "none":
        assert counted == pytest.approx(1.0, rel=0.02)
    else:
        assert 1.1 < counted < 1.4
    assert p.xla_cost_flops < p.matmul_flops  # cost_analysis counts a scanned layer once


@pytest.mark.integration
def test_a_job_that_does_not_fit_gets_the_smallest_change():
    cfg = load_config(CONFIGS / "tiny.yaml", MEDIUM)
    big = plan.plan(cfg, cpu(8), remedy=False)
    small = changed(cfg, {"train.grad_accum": 2})
    needed = plan.plan(small, cpu(8), remedy=False).memory.total
    target = cpu(8)
    target.chip = chips.Chip("tight", "cpu", (needed + big.memory.total) / 2, 1e12, 1e11, 1e10)
    p = plan.plan(cfg, target)
    assert not p.fits and p.remedy is not None and p.remedy_plan.fits
    assert "smallest change that fits" in report.report(p)
    assert report.as_json(p)["remedy"] == fit.describe(p.remedy)


def test_train_refuses_a_job_that_cannot_fit(tmp_path, monkeypatch, small_overrides):
    monkeypatch.setattr(loop, "device_memory", lambda device: 2**10)
    cfg = load_config(None, [*small_overrides, f"run_dir={tmp_path / 'run'}", "train.steps=2"])
    with pytest.raises(DoesNotFit, match="per device of 0.00 GiB"):
        train(cfg)
    assert not (tmp_path / "run").exists()  # refused before anything was written


@pytest.mark.integration
def test_sweep_ranks_every_mesh_and_remat(small_overrides):
    """On 4 devices with microbatches of 2 sequences: the 3 meshes whose data x fsdp is 4 cannot
    split a microbatch and say so; the other 3 meshes x 3 remat policies are planned and ranked
    fastest first, after them. Each plan is of its own mesh and policy, and its numbers relate as
    the roofline says; fsdp halves the weights per device and remat shrinks the temporaries."""
    cfg = load_config(None, [*small_overrides, "train.grad_accum=4"])
    rows = plan.sweep(cfg, cpu(4))
    assert len(rows) == 6 * 3  # (4,1,1) (2,2,1) (2,1,2) (1,4,1) (1,2,2) (1,1,4) x none, dots, full
    assert sorted((c["mesh.data"], c["mesh.fsdp"], c["mesh.tensor"], c["model.remat"]) for c, _ in rows) == sorted(
        (*mesh, remat) for mesh in factorizations(4) for remat in ("none", "dots", "full")
    )
    plans = [(c, p) for c, p in rows if isinstance(p, plan.Plan)]
    errors = [(c, p) for c, p in rows if not isinstance(p, plan.Plan)]
    assert rows == plans + errors  # the meshes that cannot run come last
    assert {(c["mesh.data"], c["mesh.fsdp"]) for c, _ in errors} == {(4, 1), (2, 2), (1, 4)} and len(errors) == 9
    for _, why in errors:
        assert "microbatches of 2 sequences" in why and "the 4 data-parallel devices" in why, why
    assert len(plans) == 9 and all(p.fits for _, p in plans)
    speeds = [p.tokens_per_sec for _, p in plans]
    assert all(v > 0 for v in speeds) and speeds == sorted(speeds, reverse=True)
    by_mesh = {}
    for changes, p in plans:
        assert p.mesh == {a: changes[f"mesh.{a}"] for a in AXES}
        assert p.cfg.model.remat == changes["model.remat"] and p.tokens_per_step == 8 * 32
        assert p.step_time == max(p.times["compute"], p.times["memory"], p.times["network"]) > 0
        assert p.tokens_per_sec == pytest.approx(p.tokens_per_step / p.step_time, rel=1e-12)
        m = p.memory
        assert m.params + m.optimizer + m.temporaries <= m.total and m.gradients == m.params
        by_mesh.setdefault(tuple(p.mesh.values()), {})[p.cfg.model.remat] = m
    for remats in by_mesh.values():
        assert remats["full"].temporaries <= remats["dots"].temporaries <= remats["none"].temporaries
        assert remats["full"].temporaries < remats["none"].temporaries
    fsdp2, data2 = (1, 1, 2, 1, 1, 2), (2, 1, 1, 1, 1, 2)  # data stage fsdp context expert tensor
    assert by_mesh[fsdp2]["none"].params * 2 == by_mesh[data2]["none"].params  # fsdp=2 halves them
    table = report.sweep_table(rows).splitlines()
    assert len(table) == 1 + 18 and "tensor" in table[0]
    assert sum("cannot: train.grad_accum=4 leaves microbatches" in line for line in table) == 9
    for line, (changes, _) in zip(table[1:], rows):
        assert line.split()[: len(AXES) + 1] == [str(changes[k]) for k in (*(f"mesh.{a}" for a in AXES), "model.remat")]


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "XLA_FLAGS": "", "PYTHONPATH": str(Path(__file__).parent.parent)}
    return subprocess.run(
        [sys.executable, "-m", "podtrain", "plan", *args], capture_output=True, text=True, env=env, timeout=600
    )


def test_bad_targets_exit_2():
    unknown = _cli(str(CONFIGS / "tiny.yaml"), "--target", "v9-8")
    assert unknown.returncode == 2 and "Unknown --target 'v9-8'" in unknown.stderr
    mismatch = _cli(str(CONFIGS / "tiny.yaml"), "mesh.data=4", "--target", "cpu:8")
    assert mismatch.returncode == 2 and "needs 4 devices but 8 are available" in mismatch.stderr


@pytest.mark.integration
@needs_cuda_compiler
def test_the_1b_recipe_is_planned_for_an_h100_as_its_compiler_allocates():
    """`plan --target h100` compiles for the card with no GPU here. The 1B recipe's step, which
    `scan_unroll=auto` unrolls on it, as the H100 ran it (jax 0.11.2, when unrolled layers dropped
    their remat: `remat=none`) within 15% of the 37.29 GiB it allocated, and fitting; with the
    recipe's `remat: dots`, which now holds unrolled, in less. `bench/gpu_plan.py` compares every
    measured row."""
    target = hardware.target("h100")
    ran = plan.plan(load_config(CONFIGS / "llama_1b.yaml", ["model.remat=none"]), target)
    assert ran.target.devices[0].device_kind == "NVIDIA H100 80GB HBM3" and ran.cfg.model.attention == "cudnn"
    assert ran.cfg.model.scan_unroll == 22 and ran.fits
    assert ran.memory.total / chips.GiB == pytest.approx(37.29, rel=0.15)
    shipped = plan.plan(load_config(CONFIGS / "llama_1b.yaml"), target)
    assert shipped.cfg.model.scan_unroll == 22 and shipped.memory.total < 0.9 * ran.memory.total


@needs_cuda_compiler
def test_gpu_target_in_json():
    out = _cli(str(CONFIGS / "tiny.yaml"), "--target", "h100", "--json")
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""  # the plugin's loading says nothing
    report = json.loads(out.stdout)
    assert report["fits"] is True and report["devices"] == 1
    assert report["target"] == "h100" and report["mesh"] == {
        "data": 1,
        "stage": 1,
        "fsdp": 1,
        "context": 1,
        "expert": 1,
        "tensor": 1,
    }
    chip = chips.CHIPS["h100"]
    assert report["device_bytes"] == 0.75 * chip.memory  # JAX's GPU allocator's default share

    cfg = load_config(CONFIGS / "tiny.yaml", ["model.compute_dtype=float32"])  # the weights are float32 either way
    m, t = cfg.model, cfg.train
    param_bytes, _ = _sizes(cfg)
    memory = report["bytes_per_device"]
    assert all(isinstance(v, int) and v > 0 for v in memory.values()), memory
    assert memory["params"] == memory["gradients"] == param_bytes  # float32 weights and their gradients
    assert 2 * param_bytes <= memory["optimizer"] <= 2 * param_bytes + 64  # Adam's two moments and its count
    assert memory["gradients"] <= memory["temporaries"]
    # The step's peak: the state and the batch it reads, its temporaries, and the metrics it returns
    # (the donated state's outputs reuse its buffers).
    batch_bytes = 4 * t.batch_size * (t.seq_len + 1)
    beyond = memory["total"] - (memory["params"] + memory["optimizer"] + memory["temporaries"])
    assert batch_bytes <= beyond <= batch_bytes + 4096, (beyond, batch_bytes)
    assert memory["total"] <= report["device_bytes"]

    assert report["tokens_per_step"] == t.batch_size * t.seq_len
    assert m.tie_embeddings  # so every weight, the embedding too, is in a matmul: 6N + 12LdT per token
    per_token = 6 * param_bytes / 4 + 12 * m.n_layers * m.d_model * (t.seq_len + 1) / 2
    assert report["flops_per_step"] == per_token * report["tokens_per_step"]
    assert 0.5 * report["flops_per_step"] < report["matmul_flops_per_device"] <= report["flops_per_step"]
    times = report["times_s"]
    assert times["compute"] == pytest.approx(
        max(report["matmul_flops_per_device"], report["flops_per_step"]) / chip.peak_flops, rel=1e-9
    )
    assert times["memory"] == pytest.approx(report["memory_traffic_bytes_per_device"] / chip.hbm_bandwidth, rel=1e-9)
    assert times["network"] == 0 and not any(report["collective_bytes_per_device"].values())  # one device
    assert report["step_time_s"] == times["step"] == max(times["compute"], times["memory"], times["network"]) > 0
    assert report["tokens_per_sec"] == pytest.approx(report["tokens_per_step"] / report["step_time_s"], rel=1e-9)
    assert report["mfu"] == pytest.approx(report["flops_per_step"] / report["step_time_s"] / chip.peak_flops, rel=1e-9)
    assert 0 < report["mfu"] < 1 and report["compile_s"] > 0


@pytest.mark.integration
@needs_libtpu
def test_tpu_compile_counts_the_same_flops_as_cpu():
    """The TPU compiler writes matmuls as convolutions and drops loop trip counts; counted, they
    agree with the CPU compile of the same program."""
    cfg = load_config(
        CONFIGS / "tiny.yaml",
        [*MEDIUM, "mesh.fsdp=2", "model.compute_dtype=bfloat16", "model.remat=full", "model.attention=xla"],
    )
    tpu, host = plan.plan(cfg, hardware.target("v5e-8")), plan.plan(cfg, cpu(8))
    assert tpu.matmul_flops == host.matmul_flops
    assert tpu.target.chip.name == "TPU v5e" and tpu.fits


@pytest.mark.integration
@needs_libtpu
def test_7b_recipe_fits_v4_32():
    out = _cli(str(CONFIGS / "llama_7b.yaml"), "--target", "v4-32", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["fits"] and report["devices"] == 16 and report["bytes_per_device"]["total"] < 32 * 2**30
    assert report["collective_bytes_per_device"]["all-gather"] > 0  # fsdp gathers the layers
    # Quiet on a machine without a TPU: none of libtpu's start-up warnings, no compile-cache warning.
    for noise in NOISE:
        assert noise not in out.stderr, out.stderr[-2000:]


@needs_libtpu
def test_7b_on_one_16gib_chip_does_not_fit():
    out = _cli(str(CONFIGS / "llama_7b.yaml"), "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "--target", "v5e-1")
    assert out.returncode == 3, out.stderr[-2000:]
    assert "DOES NOT FIT" in out.stdout and "Use more devices: about 16" in out.stdout
    assert math.isclose(chips.CHIPS["v5e"].memory / 2**30, 15.75)


def test_splash_attention_equals_xla_attention():
    """The Pallas kernel, run by its interpreter on the CPU: outputs and gradients of grouped-query
    causal attention as XLA's, to float32 rounding."""
    from podtrain.models.attention import splash_attention

    q, k, v = (jax.random.normal(jax.random.key(i), (2, 128, n, 64)) for i, n in enumerate((4, 2, 2)))

    def xla(q, k, v):
        return jax.nn.dot_product_attention(q, *(jax.numpy.repeat(x, 2, axis=2) for x in (k, v)), is_causal=True)

    def splash(q, k, v):
        return splash_attention(q, k, v, interpret=True)

    assert float(abs(splash(q, k, v) - xla(q, k, v)).max()) < 1e-5
    grads = [jax.grad(lambda *a, f=f: (f(*a) ** 2).sum(), argnums=(0, 1, 2))(q, k, v) for f in (splash, xla)]
    for mine, theirs in zip(*grads):
        assert float(abs(mine - theirs).max()) < 1e-4


def test_splash_attention_with_a_window_a_soft_cap_and_segments_equals_the_xla_path():
    """Gemma's and Mistral's options in the kernel: a sliding window of 48 keys (LocalMask),
    soft-capped scores and two packed documents (segment ids), against podtrain's own xla
    attention with the same window, cap and segments."""
    from podtrain.models.attention import grouped_attention, splash_attention

    q, k, v = (jax.random.normal(jax.random.key(i), (2, 128, n, 32)) for i, n in enumerate((4, 2, 2)))
    segments = jax.numpy.asarray([[0] * 50 + [1] * 78, [3] * 100 + [4] * 28])

    def xla(q, k, v):
        return grouped_attention(q, k, v, softcap=5.0, window=48, segments=(segments, segments))

    def splash(q, k, v):
        return splash_attention(q, k, v, interpret=True, softcap=5.0, window=48, segments=segments)

    assert float(abs(splash(q, k, v) - xla(q, k, v)).max()) < 1e-5
    grads = [jax.grad(lambda *a, f=f: (f(*a) ** 2).sum(), argnums=(0, 1, 2))(q, k, v) for f in (splash, xla)]
    for mine, theirs in zip(*grads):
        assert float(abs(mine - theirs).max()) < 1e-4


@pytest.mark.integration
@needs_libtpu
def test_splash_compiles_for_tpu_and_keeps_scores_off_hbm():
    """`auto` picks splash on TPU; compiled ahead of time for a v5e-8 its step needs less memory and
    moves fewer bytes than XLA's attention, which writes every (seq, seq) score block to HBM."""
    cfg = load_config(
        CONFIGS / "tiny.yaml",
        [*MEDIUM, "model.max_seq_len=512", "train.seq_len=512", "mesh.tensor=2", "model.compute_dtype=bfloat16"],
    )
    target = hardware.target("v5e-8")
    splash, xla = plan.plan(cfg, target), plan.plan(changed(cfg, {"model.attention": "xla"}), target)
    assert splash.cfg.model.attention == "splash" and splash.fits
    assert splash.memory.temporaries < xla.memory.temporaries and splash.traffic < xla.traffic


@needs_cuda_compiler
def test_windowed_layers_run_cudnn_on_a_gpu():
    """A Gemma-style stack of sliding and global layers takes cuDNN's fused attention on an H100
    (`auto`), each layer with its own window (local_window_size): the compiled step holds cuDNN's
    attention forward and backward and none of XLA's score matmuls."""
    windows = ["model.sliding_window=64", "model.full_attention_layers=[3]", "model.qk_norm=true"]
    cfg = load_config(CONFIGS / "tiny.yaml", [*windows, "model.scan_unroll=1", "train.batch_size=4"])
    target = hardware.target("h100")
    ready = plan.prepared(cfg, target)
    assert ready.cfg.model.attention == "cudnn"
    compiled = ready.compiled
    text = compiled.as_text()
    assert 'custom_call_target="__cudnn$fmhaSoftmax"' in text and "fmhaSoftmaxBackward" in text
    assert "bktgs" not in text and "btkgh,bskh" not in text  # the xla path's einsums, named in its metadata
    windows = set(re.findall(r'"sliding_window_length": ?(\d+)', text))
    assert windows == {"0", "64"}  # a kernel per kind of layer, chosen by each layer's window
