"""What a compiled program does, read from its optimized HLO text: collectives and matmul FLOPs.

`collectives(compiled.as_text())` lists every collective instruction with how many times one
execution of the program runs it: an instruction inside a scanned layer stack (an HLO while
loop with a known trip count) counts once per layer. This is what the partitioner really
emitted, so it shows what each mesh axis costs; tests audit it and `plan` predicts from it.
`matmul_flops` counts the FLOPs of every dot and convolution the same way, and
`memory_traffic` the bytes every top-level operation reads and writes, where XLA's own
`cost_analysis()` counts a loop's body once.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
}

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s+(" + "|".join(KINDS) + r")(-start)?\(")
_ARRAY = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([\d,]*)\]")
_CALLEE = re.compile(r"\b(?:body|condition|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_FRAME = re.compile(r"\bstack_frame_id=(\d+)")
_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
_SECTION_ROW = re.compile(r"^(\d+) (.*)$")
_BODY = re.compile(r"\bbody=%?([\w.\-]+)")
_OPERATION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][\w\-]*)\(([^()]*)\)")
# Operations that move no data of their own: they name, alias or control.
_NO_TRAFFIC = {
    "parameter",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "constant",
    "iota",
    "after-all",
    "partition-id",
    "replica-id",
    "opt-barrier",
}
# Replica groups come as {{0,1},{2,3}}, as an iota [groups,size]<=[dims]T(perm), or as mesh axes:
# mesh['axis_0'=2,'axis_1'=4], device_ids=([2,4]T(1,0)) {'axis_0'}.
_GROUPS = re.compile(
    r"replica_groups=(\{\{[\d,{}]*\}\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?|mesh\[[^\]]*\](?:,\s*device_ids=\((?:[^()]|\([^()]*\))*\))?\s*\{[^}]*\})"
)


@dataclass(frozen=True)
class Collective:
    kind: str  # one of KINDS
    shapes: tuple[tuple[int, ...], ...]  # the arrays it produces (a combined collective has several)
    dtype: str
    bytes: int  # of the whole arrays involved, once: all-gather's output, reduce-scatter's input
    group_size: int | None  # devices in each replica group
    replica_groups: str
    count: int  # executions per run of the program (layers of a scan count each)
    computation: str  # the HLO computation it sits in

    @property
    def total_bytes(self) -> int:
        return self.bytes * self.count


def _computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    """The instruction lines of each computation, and the entry computation's name."""
    bodies, name, entry = {}, None, None
    for line in hlo.splitlines():
        if line[:1].isdigit() or line.strip() in _TABLES:  # the stack-frame tables (`_stack_frames`)
            name = None
            continue
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            name = header.group(1)
            bodies[name] = []
            entry = name if line.startswith("ENTRY") else entry
        elif name and line.strip() and line.strip() != "}":
            bodies[name].append(line)
    return bodies, entry


def _trip_count(loop: str, bodies: dict) -> int:
    """A while loop's iterations: its known_trip_count (CPU, GPU), else the bound its condition
    compares the counter with (TPU's optimized HLO drops the annotation; a scan counts 0..n-1)."""
    known = _TRIP.search(loop)
    if known:
        return int(known.group(1))
    condition = re.search(r"\bcondition=%?([\w.\-]+)", loop)
    lines = bodies.get(condition.group(1), ()) if condition else ()
    bounds = [int(m.group(1)) for line in lines for m in [re.search(r"= s32\[\][^ ]* constant\((\d+)\)", line)] if m]
    compares_below = any("direction=LT" in line for line in lines)
    return bounds[0] if len(bounds) == 1 and compares_below else 1


def _callees(line: str) -> list[str]:
    """The computations an instruction calls: loop body and condition, branches, reducers, fusions."""
    return _CALLEE.findall(line) + [c.strip().lstrip("%") for b in _BRANCHES.findall(line) for c in b.split(",")]


def _multipliers(bodies: dict, entry: str) -> dict[str, int]:
    """Times each computation runs per execution of the entry one, through calls and while loops."""
    times: dict[str, int] = defaultdict(int)

    def visit(name: str, n: int) -> None:
        times[name] += n
        for line in bodies.get(name, ()):
            body = _BODY.search(line)
            for callee in _callees(line):
                if callee in bodies:
                    visit(callee, n * (_trip_count(line, bodies) if body and callee == body.group(1) else 1))

    visit(entry, 1)
    return times


def _group_size(groups: str) -> int | None:
    if groups.startswith("{{"):
        return len(groups[2:].split("}")[0].split(","))
    if groups.startswith("["):
        return int(groups[1:].split("]")[0].split(",")[-1])
    if groups.startswith("mesh"):
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", groups.split("]")[0]))
        return math.prod(int(sizes[a]) for a in re.findall(r"'([^']+)'", groups.rsplit("{", 1)[1]))
    return None


def collectives(hlo: str) -> list[Collective]:
    """Every collective in an optimized HLO module's text, with its executions per run."""
    bodies, entry = _computations(hlo)
    times = _multipliers(bodies, entry)
    found = []
    for name, lines in bodies.items():
        if not times.get(name):
            continue
        for line in lines:
            match = _INSTRUCTION.match(line)
            if not match:
                continue
            result, kind, started = match.groups()
            arrays = [(dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in _ARRAY.findall(result)]
            if started and kind in ("all-gather", "collective-permute"):
                arrays = (
                    arrays[len(arrays) // 2 :][:1] if kind == "collective-permute" else arrays[len(arrays) // 2 :]
                )  # (inputs, outputs[, flags])
            groups = _GROUPS.search(line)
            group_size = _group_size(groups.group(1)) if groups else None
            size = sum(DTYPE_BYTES[dtype] * math.prod(shape) for dtype, shape in arrays)
            if kind == "reduce-scatter":
                size *= group_size or 1
            found.append(
                Collective(
                    kind,
                    tuple(s for _, s in arrays),
                    arrays[0][0],
                    size,
                    group_size,
                    groups.group(1) if groups else "",
                    times[name],
                    name,
                )
            )
    return found


def summary(found: list[Collective]) -> dict[str, int]:
    """Bytes per run of the program, by kind."""
    totals = {kind: 0 for kind in KINDS}
    for c in found:
        totals[c.kind] += c.total_bytes
    return totals


def _dims(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.split(",") if d)


def _window(line: str, key: str, rank: int, default: int) -> list[list[int]]:
    """One attribute of a convolution's window={size=2x16 stride=1x15 pad=0_0x15_15 ...}, per spatial dimension."""
    found = (
        re.search(rf"\b{key}=([\d_x]+)", line.split("window={", 1)[-1].split("}", 1)[0]) if "window={" in line else None
    )
    return [[int(v) for v in d.split("_")] for d in found.group(1).split("x")] if found else [[default, default]] * rank


def _taps(out: int, kernel: int, size: int, stride: int, pad_low: int, lhs_dilate: int, rhs_dilate: int) -> int:
    """Kernel taps that land on a real input element (not padding, not a dilation hole), summed
    over the output positions of one spatial dimension: XLA's own rule for a convolution's FLOPs."""
    at = np.arange(out)[:, None] * stride + np.arange(kernel)[None, :] * rhs_dilate - pad_low
    return int(((at >= 0) & (at <= (size - 1) * lhs_dilate) & (at % lhs_dilate == 0)).sum())


def _convolution_macs(line: str, lhs: tuple, rhs: tuple, out: tuple) -> int:
    """Multiply-adds of a convolution, which is how the TPU compiler writes batched matmuls."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", line).groups()
    spatial = sorted({c for c in labels[0] if c.isdigit()})
    macs = out[labels[2].index("b")] * out[labels[2].index("f")] * rhs[labels[1].index("i")]
    sizes, strides, pads = (
        _window(line, "size", len(spatial), 1),
        _window(line, "stride", len(spatial), 1),
        _window(line, "pad", len(spatial), 0),
    )
    lhs_dilate, rhs_dilate = _window(line, "lhs_dilate", len(spatial), 1), _window(line, "rhs_dilate", len(spatial), 1)
    for i, d in enumerate(spatial):
        macs *= _taps(
            out[labels[2].index(d)],
            sizes[i][0],
            lhs[labels[0].index(d)],
            strides[i][0],
            pads[i][0],
            lhs_dilate[i][0],
            rhs_dilate[i][0],
        )
    return macs


def _matmul_macs(line: str, op: str, operands: list[str], result: str, shapes: dict) -> int:
    """Multiply-adds of a dot or convolution instruction (0 for any other)."""
    if op == "dot":
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line)
        reduced = math.prod(shapes[operands[0]][int(d)] for d in _dims(contracting.group(1))) if contracting else 1
        return math.prod(shapes[result]) * reduced
    if op == "convolution":
        return _convolution_macs(line, shapes[operands[0]], shapes[operands[1]], shapes[result])
    return 0


def _shape_of(type_text: str) -> tuple[int, ...]:
    arrays = _ARRAY.findall(type_text)
    return _dims(arrays[0][1]) if len(arrays) == 1 else ()


def _computation_flops(lines: list[str]) -> int:
    """Matmul FLOPs of one run of a computation's own instructions (2 per multiply-add)."""
    shapes, total = {}, 0
    for line, result, type_text, op, operands in _operations(lines):
        shapes[result] = _shape_of(type_text)
        total += 2 * _matmul_macs(line, op, operands, result, shapes)
    return total


def matmul_flops(hlo: str) -> int:
    """FLOPs of the dots and convolutions of one run of the program (2 per multiply-add), every
    instruction counted as often as it runs: the matmuls a device really does, remat included."""
    bodies, entry = _computations(hlo)
    times = _multipliers(bodies, entry)
    return sum(_computation_flops(lines) * times[name] for name, lines in bodies.items() if times.get(name))


def _bytes(type_text: str) -> int:
    return sum(DTYPE_BYTES[dtype] * math.prod(_dims(dims)) for dtype, dims in _ARRAY.findall(type_text))


_SLICES = ("dynamic-slice", "slice", "gather")  # read only the part they return


def _operations(lines: list[str]):
    """(line, result, its type, op, operand names) of each instruction line."""
    for line in lines:
        match = _OPERATION.match(line)
        if match:
            result, type_text, op, operands = match.groups()
            yield line, result, type_text, op, [o.strip().lstrip("%") for o in operands.split(",") if o.strip()]


def _accesses(lines: list[str], operand_sizes: list[int], result_size: int, through_converts: bool = False) -> int:
    """Bytes a fusion reads and writes, seen from its body: an operand that is only sliced is
    read in part; a buffer updated in place by dynamic-update-slice is neither read nor written
    whole, only the update is. `through_converts`: a buffer converted to another dtype around
    its update counts as updated in place too (what the CPU compiler makes of a bf16 update that
    a GPU does in place)."""
    ops = [(line, r, _bytes(type_text), op, operands) for line, r, type_text, op, operands in _operations(lines)]
    params = {r: int(re.search(r"parameter\((\d+)\)", line).group(1)) for line, r, _, op, _ in ops if op == "parameter"}
    sizes = {r: size for _, r, size, _, _ in ops}
    made_by = {r: (op, operands) for _, r, _, op, operands in ops}
    converted = {r: operands[0] for _, r, _, op, operands in ops if through_converts and op == "convert"}

    def origin(name: str) -> str:
        while name in converted:
            name = converted[name]
        return name

    read = dict(enumerate(operand_sizes))
    uses: dict[int, list] = defaultdict(list)
    for _, r, size, op, operands in ops:
        for position, name in enumerate(operands):
            if r not in converted and origin(name) in params:
                uses[params[origin(name)]].append((op, position, size))
    for i, used in uses.items():
        if all(op in _SLICES and position == 0 for op, position, _ in used):
            read[i] = sum(size for _, _, size in used)
        elif all(op == "dynamic-update-slice" and position == 0 for op, position, _ in used):
            read[i] = 0
    root = next((o[1] for o in ops if o[0].lstrip().startswith("ROOT")), ops[-1][1] if ops else None)
    op, operands = made_by.get(origin(root), (None, ()))
    if op != "dynamic-update-slice":
        return sum(read.values()) + result_size
    # Only the update is written, in the dtype of the fusion's result.
    return sum(read.values()) + sizes.get(operands[1], 0) * result_size // max(sizes[origin(root)], 1)


@dataclass(frozen=True)
class Operation:
    """A top-level operation of the compiled program (a fusion counts as one), per step."""

    name: str  # the instruction's name in the HLO
    op: str  # its opcode: fusion, copy, all-gather, ...
    shape: str  # its result type, e.g. bf16[8,2048,4096]
    source: str  # file:line of the code it was made from (its op metadata), or ""
    bytes: int  # device memory it reads and writes, loop iterations included
    flops: int  # matmul FLOPs inside it, loop iterations included


def _stack_frames(hlo: str) -> dict[str, str]:
    """Stack frame id -> "file.py:line" of the code that made an instruction, from the tables that
    close the HLO text (FileNames, FunctionNames, FileLocations, StackFrames)."""
    tables: dict[str, dict[str, str]] = {}
    section = None
    for line in hlo.splitlines():
        if line.strip() in _TABLES:
            section = tables.setdefault(line.strip(), {})
        elif section is not None and (row := _SECTION_ROW.match(line)):
            section[row.group(1)] = row.group(2)
        else:
            section = None
    files, frames = tables.get("FileNames", {}), {}
    for frame, text in tables.get("StackFrames", {}).items():
        location = tables.get("FileLocations", {}).get(re.search(r"file_location_id=(\d+)", text).group(1), "")
        file, line = re.search(r"file_name_id=(\d+)", location), re.search(r"\bline=(\d+)", location)
        if file and line:
            name = files.get(file.group(1), "?").strip('"').rsplit("/", 1)[-1]
            frames[frame] = f"{name}:{line.group(1)}"
    return frames


def _source(frames: dict[str, str], line: str, body: list[str] = ()) -> str:
    """Where an instruction comes from: its own stack frame, else the first of its body's."""
    for text in (line, *body):
        if (frame := _FRAME.search(text)) and frame.group(1) in frames:
            return frames[frame.group(1)]
    return ""


def operations(hlo: str, through_converts: bool = False) -> list[Operation]:
    """Every top-level operation of one run of the program with the bytes it moves: each reads
    its operands and writes its result (a fusion as its body sees them), once per loop
    iteration, as XLA's cost analysis counts them; what happens inside a fusion stays on chip.
    `through_converts` counts buffers converted around an in-place update as updated in place
    (see `_accesses`): for a GPU's step compiled on a CPU."""
    bodies, entry = _computations(hlo)
    frames, found = _stack_frames(hlo), []

    def visit(name: str, times: int) -> None:
        sizes, shapes = {}, {}
        for line, result, type_text, op, operands in _operations(bodies.get(name, ())):
            sizes[result] = size = _bytes(type_text)
            shapes[result] = _shape_of(type_text)
            called = bodies.get(m.group(1), ()) if (m := re.search(r"\bcalls=%?([\w.\-]+)", line)) else ()
            if op == "while":
                visit(_BODY.search(line).group(1), times * _trip_count(line, bodies))
                continue
            if op in ("call", "conditional"):
                for callee in _callees(line):
                    visit(callee, times)
                continue
            if op == "fusion":
                moved = _accesses(called, [sizes.get(o, 0) for o in operands], size, through_converts)
            elif op in _SLICES:
                moved = 2 * size
            elif op == "dynamic-update-slice":
                moved = 2 * sizes.get(operands[1], 0)
            elif op in _NO_TRAFFIC:
                moved = 0
            else:
                moved = size + sum(sizes.get(o, 0) for o in operands)
            if op == "fusion":
                flops = _computation_flops(called)
            else:
                flops = 2 * _matmul_macs(line, op, operands, result, shapes)
            if moved or flops:
                shape = type_text.strip()
                found.append(Operation(result, op, shape, _source(frames, line, called), moved * times, flops * times))

    visit(entry, 1)
    return found


def memory_traffic(hlo: str) -> int:
    """Bytes of device memory one run of the program reads and writes (see `operations`)."""
    return sum(o.bytes for o in operations(hlo))


def top(found: list[Operation], n: int, by: str) -> list[Operation]:
    """The n operations that move the most bytes (by="bytes") or do the most FLOPs (by="flops")."""
    return sorted((o for o in found if getattr(o, by)), key=lambda o: -getattr(o, by))[:n]
