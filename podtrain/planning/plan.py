"""`podtrain plan`: before booking the hardware, compile the job's train step for it and say
whether it fits, what it moves between devices and how fast it should run.

The step is the one `train` compiles (same function, same shardings), built from abstract shapes:
no weights are allocated and no data is read. Memory comes from XLA's `memory_analysis()`,
FLOPs, bytes and collectives from the optimized HLO (`planning.cost`, `planning.hlo`; loops counted
per iteration), and the step time from a roofline over the chip's constants (`runtime.chips`):

    compute  = matmul FLOPs per device / peak FLOP/s          (remat's recomputation included;
               at least the model's FLOPs per device, which a Pallas kernel's hide from the HLO;
               fp8 or int8 matmuls at the chip's rate for them: `planning.precision`)
    memory   = bytes each operation reads and writes / HBM bandwidth     (a fusion's insides stay on chip)
    network  = ring bytes of every collective / link bandwidth   (all-reduce 2(n-1)/n of its size,
               all-gather, reduce-scatter and all-to-all (n-1)/n, a permute all of it)
    dcn      = bytes sent to other slices or hosts / their network bandwidth   (`planning.network`)
    step     = max(compute, memory, network, dcn)   (XLA overlaps collectives with compute)

MFU is the model's FLOPs (6N + 12LdT per token, T the keys a causal query sees: (seq + 1) / 2;
`models.flops_per_token`) over the step at peak:
what a perfect run at the roofline would reach, an upper bound for the real one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from podtrain.axes import AXES, DCN_AXES, PLAIN_AXES
from podtrain.config.schema import Config
from podtrain.errors import PodtrainError
from podtrain.models.layers import REMAT_POLICIES
from podtrain.models.ops import PRECISIONS
from podtrain.planning import cost, fit, hlo, network, precision
from podtrain.planning.targets import Target
from podtrain.program.checks import changed
from podtrain.program.memory import Memory
from podtrain.program.prepare import Prepared, prepare
from podtrain.runtime.mesh import build_mesh, factorizations, resolve_shape, slices
from podtrain.sharding import microbatches_over

TOP_KEPT = 50  # operations a plan keeps of each ranking, for `plan --top N`


@dataclass
class Plan:
    target: Target
    cfg: Config
    mesh: dict[str, int]  # each axis's size
    memory: Memory
    tokens_per_step: int
    flops_per_step: float  # the model's, all devices
    matmul_flops: float | None  # per device, from the compiled HLO (None if not compiled)
    narrow_flops: float | None  # of which in model.matmul_precision's fp8 or int8 (0 under "compute")
    xla_cost_flops: float | None  # per device, XLA's cost_analysis(): a scanned layer counted once
    traffic: float | None = None  # bytes per device read and written in device memory per step
    collectives: dict = field(default_factory=dict)  # bytes per device per step, by kind
    axes_bytes: dict = field(default_factory=dict)  # bytes per device per step, by the mesh axes they travel
    dcn: float | None = None  # bytes per device per step sent to other slices
    times: dict = field(default_factory=dict)  # compute, memory, network and step seconds
    compile_s: float = 0.0
    top_bytes: list[cost.Operation] = field(default_factory=list)  # the operations moving the most bytes
    top_flops: list[cost.Operation] = field(default_factory=list)  # the operations doing the most FLOPs
    remedy: dict | None = None  # the smallest change that fits, when this does not
    remedy_plan: Plan | None = None

    @property
    def fits(self) -> bool:
        return self.memory.fits

    @property
    def step_time(self) -> float | None:
        return self.times.get("step")

    @property
    def tokens_per_sec(self) -> float | None:
        return self.tokens_per_step / self.step_time if self.step_time else None

    @property
    def bubble(self) -> float:
        """The share of a pipelined step its stages idle: (S - 1) / (R M + S - 1). In the one SPMD
        program idle stages compute on placeholders, so the compiled FLOPs already hold it."""
        stages, pipeline = self.mesh["stage"], self.cfg.pipeline
        return (stages - 1) / (pipeline.repeats * microbatches_over(stages, pipeline.microbatches) + stages - 1)

    @property
    def mfu(self) -> float | None:
        peak = self.target.chip.peak_flops * len(self.target.devices)
        return self.flops_per_step / self.step_time / peak if self.step_time else None


def _roofline(p: Plan, found: list) -> dict:
    chip, target, narrow = p.target.chip, p.target, p.narrow_flops
    # A Pallas kernel (splash attention) is a custom call whose FLOPs the HLO does not show: the
    # model's share of FLOPs per device is the floor.
    matmuls = max(p.matmul_flops, p.flops_per_step / len(target.devices))
    times = {
        "compute": precision.compute_seconds(chip, matmuls, narrow, p.cfg.model.matmul_precision),
        "memory": p.traffic / chip.hbm_bandwidth,
        "network": network.link_bytes(found) / chip.link_bandwidth,
        **({"dcn": p.dcn / chip.dcn_bandwidth} if target.slices > 1 else {}),
    }
    return {**times, "step": max(times.values())}


def prepared(cfg: Config, target: Target) -> Prepared:
    """cfg's job made final and compiled for the target, from abstract shapes."""
    return prepare(cfg, target.platform, build_mesh(cfg.mesh, target.devices), target.chip.memory, data=False)


def plan(cfg: Config, target: Target, remedy: bool = True) -> Plan:
    """Compile cfg's train step for the target and predict; with `remedy`, a job that does not fit
    also gets the smallest usual change that does."""
    clock = time.perf_counter()
    ready = prepared(cfg, target)
    compile_s = time.perf_counter() - clock
    cfg, job, memory, compiled = ready.cfg, ready.job, ready.memory, ready.compiled
    n = len(target.devices)
    mesh = job.setup.fns.mesh
    result = Plan(
        target,
        cfg,
        resolve_shape(cfg.mesh, n, target.slices),
        memory,
        job.tokens_per_step,
        job.flops_per_step,
        None,
        None,
        None,
        compile_s=compile_s,
    )
    if compiled is not None:
        text = compiled.as_text()
        found = hlo.collectives(text)
        result.matmul_flops = float(cost.matmul_flops(text))
        policy = cfg.model.matmul_precision
        result.narrow_flops = 0.0 if PRECISIONS[policy] is None else float(cost.matmul_flops(text, policy))
        result.xla_cost_flops = _cost_flops(compiled)
        result.collectives, result.axes_bytes = hlo.summary(found), hlo.by_axes(found, result.mesh)
        ops = cost.operations(text)
        result.traffic = float(sum(o.bytes for o in ops))
        result.top_bytes, result.top_flops = cost.top(ops, TOP_KEPT, "bytes"), cost.top(ops, TOP_KEPT, "flops")
        slice_index = {d.id: k for k, group in enumerate(slices(target.devices)) for d in group}
        result.dcn = hlo.megascale_sends(text) + network.across_hosts(
            found, [slice_index[d.id] for d in mesh.devices.flat]
        )
        result.times = _roofline(result, found)
    if remedy and not memory.fits:
        result.remedy, result.remedy_plan = fit.smallest_fix(
            cfg, target.devices, lambda c: plan(c, target, remedy=False)
        )
    return result


def _cost_flops(compiled) -> float | None:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost["flops"]) if cost and "flops" in cost else None


def sweep(cfg: Config, target: Target) -> list[tuple[dict, Plan | str]]:
    """Every mesh whose product is the device count, under each remat policy: its plan, or why the
    model cannot take it; fitting plans first, fastest first. The stage, context and expert axes
    are tried only where the config uses them (other than 1), expert also for a model with
    experts; else they stay 1. Over several slices, each split of them between the dcn axes too."""
    rows, per_slice = [], len(target.devices) // target.slices
    experts = getattr(cfg.model, "experts", 1) > 1
    tried = [a for a in AXES if a in PLAIN_AXES or getattr(cfg.mesh, a) != 1 or (a == "expert" and experts)]
    meshes = [
        {f"mesh.{a}": 1 for a in AXES}
        | {f"mesh.{a}": s for a, s in zip(tried, sizes)}
        | {f"mesh.dcn_{a}": s for a, s in zip(DCN_AXES, across)}
        for across in factorizations(target.slices, len(DCN_AXES))
        for sizes in factorizations(per_slice, len(tried))
    ]
    for mesh in meshes:
        for remat in REMAT_POLICIES:
            changes = {**mesh, "model.remat": remat}
            try:
                rows.append((changes, plan(changed(cfg, changes), target, remedy=False)))
            except PodtrainError as e:
                rows.append((changes, str(e)))
    return sorted(rows, key=_rank)


def _rank(row: tuple) -> tuple:
    """Plans that fit, fastest first; then those that do not; then meshes the model cannot take."""
    p = row[1]
    return (2, 0.0) if isinstance(p, str) else (0 if p.fits else 1, -(p.tokens_per_sec or 0.0))
