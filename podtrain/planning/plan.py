"""`podtrain plan`: before booking the hardware, compile the job's train step for it and say
whether it fits, what it moves between devices and how fast it should run.

The step is the one `train` compiles (same function, same shardings), built from abstract shapes:
no weights are allocated and no data is read. Memory comes from XLA's `memory_analysis()`,
FLOPs, bytes and collectives from the optimized HLO (`planning.cost`, `planning.hlo`; loops counted
per iteration), and the step time from a roofline over the chip's constants (`runtime.chips`):

    compute  = matmul FLOPs per device / peak FLOP/s          (remat's recomputation included;
               at least the model's FLOPs per device, which a Pallas kernel's hide from the HLO)
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

from podtrain.config.checks import resolve_auto
from podtrain.config.schema import Config
from podtrain.errors import PodtrainError
from podtrain.planning import cost, fit, hlo, network
from podtrain.planning.targets import Target
from podtrain.runtime.chips import GiB
from podtrain.runtime.mesh import DCN_AXES, build_mesh, factorizations, resolve_shape, slices
from podtrain.sharding import AXES, PLAIN_AXES, microbatches_over
from podtrain.train.job import build

TOP_KEPT = 50  # operations a plan keeps of each ranking, for `plan --top N`


@dataclass
class Plan:
    target: Target
    cfg: Config
    mesh: dict[str, int]  # each axis's size
    memory: fit.Memory
    tokens_per_step: int
    flops_per_step: float  # the model's, all devices
    matmul_flops: float | None  # per device, from the compiled HLO (None if not compiled)
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


def _roofline(target: Target, matmul_flops: float, model_flops: float, traffic: float, found: list, dcn: float) -> dict:
    chip = target.chip
    times = {
        # A Pallas kernel (splash attention) is a custom call whose FLOPs the HLO does not show:
        # the model's share of FLOPs per device is the floor.
        "compute": max(matmul_flops, model_flops / len(target.devices)) / chip.peak_flops,
        "memory": traffic / chip.hbm_bandwidth,
        "network": network.link_bytes(found) / chip.link_bandwidth,
        **({"dcn": dcn / chip.dcn_bandwidth} if target.slices > 1 else {}),
    }
    return {**times, "step": max(times.values())}


def for_target(cfg: Config, target: Target) -> Config:
    """`auto` settings as the target takes them; a GPU's scan_unroll by its compiled step's memory."""
    cfg = resolve_auto(cfg, target.platform)
    return fit.choose_unroll(cfg, build_mesh(cfg.mesh, target.devices), target.chip.memory)


def plan(cfg: Config, target: Target, remedy: bool = True) -> Plan:
    """Compile cfg's train step for the target and predict; with `remedy`, a job that does not fit
    also gets the smallest usual change that does."""

    def unrolled_plan(unrolled_cfg: Config) -> tuple[fit.Memory, Plan]:
        p = plan(unrolled_cfg, target, remedy=False)
        return p.memory, p

    cfg, unrolled = fit.settle_unroll(resolve_auto(cfg, target.platform), unrolled_plan)  # a GPU's auto
    if unrolled:
        return unrolled
    n = len(target.devices)
    mesh = build_mesh(cfg.mesh, target.devices)
    job = build(cfg, mesh, data=False)
    clock = time.perf_counter()
    memory, compiled = fit.measure(job, target.chip.memory)
    result = Plan(
        target,
        cfg,
        resolve_shape(cfg.mesh, n, target.slices),
        memory,
        job.tokens_per_step,
        job.flops_per_step,
        None,
        None,
        compile_s=time.perf_counter() - clock,
    )
    if compiled is not None:
        text = compiled.as_text()
        found = hlo.collectives(text)
        result.matmul_flops = float(cost.matmul_flops(text))
        result.xla_cost_flops = _cost_flops(compiled)
        result.collectives, result.axes_bytes = hlo.summary(found), hlo.by_axes(found, result.mesh)
        ops = cost.operations(text)
        result.traffic = float(sum(o.bytes for o in ops))
        result.top_bytes, result.top_flops = cost.top(ops, TOP_KEPT, "bytes"), cost.top(ops, TOP_KEPT, "flops")
        slice_index = {d.id: k for k, group in enumerate(slices(target.devices)) for d in group}
        result.dcn = hlo.megascale_sends(text) + network.across_hosts(
            found, [slice_index[d.id] for d in mesh.devices.flat]
        )
        result.times = _roofline(target, result.matmul_flops, job.flops_per_step, result.traffic, found, result.dcn)
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
        for remat in ("none", "dots", "full"):
            changes = {**mesh, "model.remat": remat}
            try:
                rows.append((changes, plan(fit.changed(cfg, changes), target, remedy=False)))
            except PodtrainError as e:
                rows.append((changes, str(e)))
    return sorted(rows, key=_rank)


def _rank(row: tuple) -> tuple:
    """Plans that fit, fastest first; then those that do not; then meshes the model cannot take."""
    p = row[1]
    return (2, 0.0) if isinstance(p, str) else (0 if p.fits else 1, -(p.tokens_per_sec or 0.0))


def _op_json(o: cost.Operation) -> dict:
    return {"name": o.name, "op": o.op, "shape": o.shape, "source": o.source, "bytes": o.bytes, "flops": o.flops}


def as_json(p: Plan, top: int = 0) -> dict:
    m = p.memory
    out = {
        "target": p.target.name,
        "chip": p.target.chip.name,
        "devices": len(p.target.devices),
        "mesh": p.mesh,
        "remat": p.cfg.model.remat,
        "attention": p.cfg.model.attention,
        "grad_accum": p.cfg.train.grad_accum,
        "fits": p.fits,
        "bytes_per_device": {
            "params": m.params,
            "optimizer": m.optimizer,
            "gradients": m.gradients,
            "temporaries": m.temporaries,
            "total": m.total,
        },
        "device_bytes": m.available,
        "flops_per_step": p.flops_per_step,
        "matmul_flops_per_device": p.matmul_flops,
        "xla_cost_analysis_flops_per_device": p.xla_cost_flops,
        "memory_traffic_bytes_per_device": p.traffic,
        "collective_bytes_per_device": p.collectives,
        "collective_bytes_by_mesh_axes": p.axes_bytes,
        "slices": p.target.slices,
        "pipeline_bubble": p.bubble,
        "dcn_bytes_per_device": p.dcn,
        "times_s": p.times,
        "step_time_s": p.step_time,
        "tokens_per_step": p.tokens_per_step,
        "tokens_per_sec": p.tokens_per_sec,
        "mfu": p.mfu,
        "compile_s": p.compile_s,
    }
    if top:
        out["top_bytes"] = [_op_json(o) for o in p.top_bytes[:top]]
        out["top_flops"] = [_op_json(o) for o in p.top_flops[:top]]
    if not p.fits:
        out["remedy"] = fit.describe(p.remedy) if p.remedy else None
        out["advice"] = fit.advice(m, len(p.target.devices), p.remedy)
        out["remedy_plan"] = as_json(p.remedy_plan) if p.remedy_plan else None
    return out


def _hand_offs(p: Plan) -> str:
    if p.target.slices > 1 and p.cfg.mesh.dcn_stage != 1:  # the TPU's compiler makes them host transfers
        return "between slices, on the dcn line"
    return f"{p.collectives.get('collective-permute', 0) / 2**20:,.1f} MiB per device per step"


def _schedule(p: Plan) -> str:
    pipeline = p.cfg.pipeline
    laps = f", circular, {pipeline.repeats} laps" if pipeline.repeats > 1 else ", gpipe"
    micro = microbatches_over(p.mesh["stage"], pipeline.microbatches)
    return f"{p.mesh['stage']} stages, {micro} microbatches{laps}"


def _speed(p: Plan) -> str:
    if not p.step_time:
        return "no prediction (not compiled: it does not fit)"
    bound = max((k for k in p.times if k != "step"), key=p.times.get)
    return f"step {p.step_time * 1e3:,.1f} ms ({bound}-bound), {p.tokens_per_sec:,.0f} tokens/s, MFU {p.mfu:.1%}"


def top_table(p: Plan, n: int) -> list[str]:
    """The n operations of the step moving the most bytes, then the n doing the most FLOPs: their
    share of the step's, the model code they come from, and the HLO instruction's name."""
    lines = []
    for title, ops, total in (("bytes", p.top_bytes[:n], p.traffic), ("flops", p.top_flops[:n], p.matmul_flops)):
        lines.append(
            f"top {title:<8}{'share':>6}  {'per step':>10}  {'source':<22} {'op':<13} {'result':<28} instruction"
        )
        for o in ops:
            amount = getattr(o, title)
            shape = o.shape.split("{")[0]  # without the layout
            shape = shape if len(shape) <= 28 else shape[:25] + "..."
            size = fit.size(amount) if title == "bytes" else f"{amount:.3g}"
            share = amount / total if total else 0
            lines.append(f"{'':12}{share:>6.1%}  {size:>10}  {o.source or '-':<22} {o.op:<13} {shape:<28} {o.name}")
    return lines


def report(p: Plan, top: int = 0) -> str:
    """The plan as a user reads it."""
    m, c = p.memory, p.cfg
    lines = [
        f"target      {p.target.label}",
        f"job         {c.model.name}, {c.model.compute_dtype} compute, {c.model.attention} attention, "
        f"remat {c.model.remat}, scan_unroll {c.model.scan_unroll}, batch "
        f"{c.train.batch_size} x {p.tokens_per_step // c.train.batch_size} (grad_accum {c.train.grad_accum}), "
        f"mesh {' '.join(f'{a}={n}' for a, n in p.mesh.items())}, compiled in {p.compile_s:.1f} s",
        f"memory      {m.summary()}: " + ("fits" if p.fits else "DOES NOT FIT"),
        f"flops       model {p.flops_per_step:.3g} per step"
        + (
            f"; compiled matmuls {p.matmul_flops:.3g} per device x {len(p.target.devices)} = "
            f"{p.matmul_flops * len(p.target.devices) / p.flops_per_step:.2f}x the model's"
            if p.matmul_flops
            else ""
        )
        + (f"; XLA cost_analysis {p.xla_cost_flops:.3g} (counts a scanned layer once)" if p.xla_cost_flops else ""),
        f"traffic     {fit.size(p.traffic)} read and written in device memory per device per step"
        if p.traffic
        else "traffic     -",
        "network     "
        + (", ".join(f"{k} {v / 2**20:,.1f} MiB" for k, v in p.collectives.items() if v) or "no collectives")
        + " per device per step"
        + (
            f"; along {', '.join(f'{k} {v / 2**20:,.1f} MiB' for k, v in p.axes_bytes.items())}" if p.axes_bytes else ""
        ),
        *(
            [
                f"dcn         {fit.size(p.dcn)} per device per step between the {p.target.slices} slices, at "
                f"{p.target.chip.dcn_bandwidth / 1e9:g} GB/s per device: {p.times.get('dcn', 0) * 1e3:,.1f} ms"
            ]
            if p.target.slices > 1 and p.dcn is not None
            else []
        ),
        *(
            [f"pipeline    {_schedule(p)}: bubble {p.bubble:.1%} of the step; stage hand-offs {_hand_offs(p)}"]
            if p.mesh["stage"] > 1
            else []
        ),
        f"speed       {_speed(p)}",
    ]
    if p.times:
        lines.append("roofline    " + ", ".join(f"{k} {v * 1e3:,.2f} ms" for k, v in p.times.items() if k != "step"))
    if top:
        lines += top_table(p, top)
    if not p.fits:
        lines.append(f"remedy      {fit.advice(m, len(p.target.devices), p.remedy)}")
        if p.remedy_plan:
            lines.append(
                f"            with it: {fit.size(p.remedy_plan.memory.total)} per device, {_speed(p.remedy_plan)}"
            )
    return "\n".join(lines)


def sweep_table(rows: list) -> str:
    across = any(changes.get(f"mesh.dcn_{a}", 1) != 1 for changes, _ in rows for a in DCN_AXES)
    axes = [*AXES, *(f"dcn_{a}" for a in DCN_AXES)] if across else list(AXES)
    lines = [
        " ".join(f"{a:>4}" for a in axes)
        + f" {'remat':>5}  {'GiB/device':>10}  {'fits':>4}  {'step ms':>9}  {'tokens/s':>10}  {'MFU':>6}"
    ]
    for changes, p in rows:
        mesh = " ".join(f"{changes[f'mesh.{a}']:>{max(4, len(a))}}" for a in axes) + f" {changes['model.remat']:>5}"
        if isinstance(p, str):
            lines.append(f"{mesh}  cannot: {p.split('. ')[0]}")
        else:
            speed = (
                f"{p.step_time * 1e3:>9,.1f}  {p.tokens_per_sec:>10,.0f}  {p.mfu:>6.1%}"
                if p.step_time
                else f"{'-':>9}  {'-':>10}  {'-':>6}"
            )
            lines.append(f"{mesh}  {p.memory.total / GiB:>10.2f}  {'yes' if p.fits else 'no':>4}  {speed}")
    return "\n".join(lines)
