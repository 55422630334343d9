"""A plan in words: the report a user reads (`podtrain plan`), its JSON (`--json`), the table of a
`--sweep`."""

from __future__ import annotations

from podtrain.axes import AXES, DCN_AXES
from podtrain.planning import cost, fit, precision
from podtrain.planning.plan import Plan
from podtrain.program.memory import size
from podtrain.runtime.chips import GiB
from podtrain.sharding import microbatches_over


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
        "matmul_precision": p.cfg.model.matmul_precision,
        "narrow_matmul_flops_per_device": p.narrow_flops,
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
            amount_text = size(amount) if title == "bytes" else f"{amount:.3g}"
            share = amount / total if total else 0
            lines.append(
                f"{'':12}{share:>6.1%}  {amount_text:>10}  {o.source or '-':<22} {o.op:<13} {shape:<28} {o.name}"
            )
    return lines


def _precision(p: Plan) -> tuple:
    return p.target.chip, p.cfg.model.matmul_precision, p.matmul_flops, p.narrow_flops


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
        *([f"precision   {said}"] if (said := precision.sentence(*_precision(p))) else []),
        f"traffic     {size(p.traffic)} read and written in device memory per device per step"
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
                f"dcn         {size(p.dcn)} per device per step between the {p.target.slices} slices, at "
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
            lines.append(f"            with it: {size(p.remedy_plan.memory.total)} per device, {_speed(p.remedy_plan)}")
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
