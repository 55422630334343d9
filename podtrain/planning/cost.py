"""What a compiled program costs, read from its optimized HLO text: the FLOPs of its matmuls and
the bytes each top-level operation moves through device memory, every instruction counted as
often as it runs (XLA's own `cost_analysis()` counts a loop's body once).

`operations(compiled.as_text())` lists the top-level operations (a fusion is one) with the bytes
each reads and writes, its matmul FLOPs and the model line it was made from; `plan` sums them for
its roofline and ranks them for `--top`.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from podtrain.models.ops import ROWS_SCOPE
from podtrain.planning import hlo

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
# A custom call that only reserves a buffer (the TPU compiler's for a scan's stacked outputs, which
# the loop then fills by in-place updates): no bytes move until those updates.
_ALLOCATION = re.compile(r'custom_call_target="AllocateBuffer"')
_FRAME = re.compile(r"\bstack_frame_id=(\d+)")
_KERNEL_COST = re.compile(r'"cost_estimate":\{"flops":"(\d+)"[^}]*"bytes_accessed":"(\d+)"')
_SECTION_ROW = re.compile(r"^(\d+) (.*)$")
PASSED = ("ops.py:",)  # files an operation's source skips for their caller: every matmul is made in ops.py
_ROWS = re.compile(r'op_name="[^"]*' + ROWS_SCOPE + r"(\d+)_of_(\d+)")


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
        reduced = math.prod(shapes[operands[0]][int(d)] for d in hlo.dims(contracting.group(1))) if contracting else 1
        return math.prod(shapes[result]) * reduced
    if op == "convolution":
        return _convolution_macs(line, shapes[operands[0]], shapes[operands[1]], shapes[result])
    return 0


def _kernel_cost(line: str) -> tuple[int, int] | None:
    """(FLOPs, bytes accessed) a Pallas kernel's custom call declares (its CostEstimate), if any:
    its matmuls are inside the kernel, where no dot instruction shows them. A grouped matmul
    declares every row it was given, room included; one whose name scope says it runs R of its M
    rows (`models.ops.grouped_matmul`) counts R / M of both, its costs being the rows'."""
    found = _KERNEL_COST.search(line)
    if not found:
        return None
    rows = _ROWS.search(line)
    share = int(rows.group(1)) / int(rows.group(2)) if rows else 1
    return round(int(found.group(1)) * share), round(int(found.group(2)) * share)


def _flops(line: str, op: str, operands: list[str], result: str, shapes: dict) -> int:
    """FLOPs of one instruction: its matmul's (2 per multiply-add), or what a kernel declares."""
    if op == "custom-call":
        return (_kernel_cost(line) or (0, 0))[0]
    return 2 * _matmul_macs(line, op, operands, result, shapes)


# A matmul's format by its operands' element type: those the chips multiply faster than bfloat16
# (models/ops.py's policies; `Chip.narrow_flops`).
NARROW = {"f8e4m3fn": "fp8", "f8e5m2": "fp8", "f8e4m3": "fp8", "s8": "int8"}


def _computation_flops(lines: list[str], narrow: str | None = None) -> int:
    """Matmul FLOPs of one run of a computation's own instructions; with `narrow` ("fp8", "int8")
    only those of matmuls whose operands are all of that format."""
    shapes, formats, total = {}, {}, 0
    for line, result, type_text, op, operands in hlo.instructions(lines):
        shapes[result] = hlo.shape_of(type_text)
        formats[result] = NARROW.get(type_text.split("[", 1)[0].strip())
        if narrow is None or (operands and all(formats.get(o) == narrow for o in operands[:2])):
            total += _flops(line, op, operands, result, shapes)
    return total


def matmul_flops(text: str, narrow: str | None = None) -> int:
    """FLOPs of the dots and convolutions of one run of the program (2 per multiply-add), every
    instruction counted as often as it runs: the matmuls a device really does, remat included.
    With `narrow`, only those of that format's operands (a fusion's parameters carry their type)."""
    bodies, entry = hlo.computations(text)
    times = hlo.multipliers(bodies, entry)
    return sum(_computation_flops(lines, narrow) * times[name] for name, lines in bodies.items() if times.get(name))


_SLICES = ("dynamic-slice", "slice", "gather")  # read only the part they return
_FREE = ("bitcast",)  # a new name for the same bytes


def _body(lines: list[str]):
    """A fusion body's instructions as (line, name, bytes, op, operands), and `origin`: the
    instruction a name stands for through bitcasts."""
    ops = [(line, r, hlo.nbytes(t), op, operands) for line, r, t, op, operands in hlo.instructions(lines)]
    passed = {r: operands[0] for _, r, _, op, operands in ops if op in _FREE}

    def origin(name: str) -> str:
        while name in passed:
            name = passed[name]
        return name

    return ops, passed, origin


def _partial_reads(lines: list[str], bodies: dict) -> dict[int, int]:
    """Parameters a fusion body reads only in part: index -> bytes read. A parameter only sliced
    (also inside a nested fusion) reads its slices; one only updated in place by
    dynamic-update-slice reads nothing; one read any other way is missing (read whole)."""
    ops, passed, origin = _body(lines)
    params = {r: int(re.search(r"parameter\((\d+)\)", line).group(1)) for line, r, _, op, _ in ops if op == "parameter"}
    parts: dict[int, list] = defaultdict(list)
    for line, r, size, op, operands in ops:
        for position, name in enumerate(operands):
            if r in passed or origin(name) not in params:
                continue
            if op in _SLICES and position == 0:
                read = size
            elif op == "dynamic-update-slice" and position == 0:
                read = 0
            elif op == "fusion" and (called := re.search(r"\bcalls=%?([\w.\-]+)", line)):
                read = _partial_reads(bodies.get(called.group(1), ()), bodies).get(position)
            else:
                read = None
            parts[params[origin(name)]].append(read)
    return {i: sum(reads) for i, reads in parts.items() if None not in reads}


def _accesses(lines: list[str], bodies: dict, operand_sizes: list[int], result_sizes: list[int]) -> int:
    """Bytes of device memory a fusion reads and writes, seen from its body, given the device-memory
    size of each operand and of each result (0 for one on chip): an operand that is only sliced
    is read in part (`_partial_reads`); a buffer updated in place by dynamic-update-slice (a result
    of its own, or one of a tuple of results) is neither read nor written whole, only the update is
    written."""
    partial = _partial_reads(lines, bodies)
    read = sum(min(size, partial.get(i, size)) for i, size in enumerate(operand_sizes))
    listed, _, origin = _body(lines)
    ops = {r: (op, operands, size) for _, r, size, op, operands in listed}
    root = next((r for line, r, *_ in listed if line.lstrip().startswith("ROOT")), None)
    op, operands, _ = ops.get(origin(root), (None, (), 0)) if root else (None, (), 0)
    outputs = operands if op == "tuple" else [root]
    written = 0
    for name, size in zip(outputs, result_sizes):
        op, operands, whole = ops.get(origin(name), (None, (), 0))
        # Only the update is written, in the dtype of the result.
        written += ops[operands[1]][2] * size // max(whole, 1) if op == "dynamic-update-slice" else size
    return read + written


def _async_start(op: str, type_text: str, operand_sizes: list[int]) -> int:
    """Bytes of device memory an asynchronous operation moves, counted at its start (its done
    moves nothing more). A copy's start is (destination, source, context): each side in device
    memory counts once (a prefetch to or an eviction from on-chip memory moves its bytes once); a
    slice's start is ((operand), slice, context) and reads only the slice."""
    parts = [hlo.device_memory_bytes(e) for e in hlo.elements(type_text)]
    if op == "copy-start":
        return sum(parts[0]) + sum(parts[1])
    if op == "slice-start":
        sliced = hlo.nbytes(hlo.elements(type_text)[1])
        return (sliced if sum(operand_sizes) else 0) + sum(parts[1])
    if op == "ragged-all-to-all-start":  # ((operands), output): the rows it sends, read and written
        return 2 * min(operand_sizes[0], sum(parts[1]))
    return sum(operand_sizes) + sum(sum(p) for p in parts[1:2])


@dataclass(frozen=True)
class Operation:
    """A top-level operation of the compiled program (a fusion counts as one), per step."""

    name: str  # the instruction's name in the HLO
    op: str  # its opcode: fusion, copy, all-gather, ...
    shape: str  # its result type, e.g. bf16[8,2048,4096]
    source: str  # file:line of the code it was made from (its op metadata), or ""
    bytes: int  # device memory it reads and writes, loop iterations included
    flops: int  # matmul FLOPs inside it, loop iterations included


def _stack_frames(text: str) -> dict[str, str]:
    """Stack frame id -> "file.py:line" of the code that made an instruction, from the tables that
    close the HLO text (FileNames, FunctionNames, FileLocations, StackFrames)."""
    tables: dict[str, dict[str, str]] = {}
    section = None
    for line in text.splitlines():
        if line.strip() in hlo.TABLES:
            section = tables.setdefault(line.strip(), {})
        elif section is not None and (row := _SECTION_ROW.match(line)):
            section[row.group(1)] = row.group(2)
        else:
            section = None
    files, places, callers = tables.get("FileNames", {}), {}, {}
    for frame, text in tables.get("StackFrames", {}).items():
        location = tables.get("FileLocations", {}).get(re.search(r"file_location_id=(\d+)", text).group(1), "")
        file, line = re.search(r"file_name_id=(\d+)", location), re.search(r"\bline=(\d+)", location)
        if file and line:
            name = files.get(file.group(1), "?").strip('"').rsplit("/", 1)[-1]
            places[frame] = f"{name}:{line.group(1)}"
        # The table numbers frames from 1 and its parent ids from 1 above them (1: none).
        callers[frame] = str(int(re.search(r"parent_frame_id=(\d+)", text).group(1)) - 1)
    frames = {}
    for frame in places:
        at = frame
        while places[at].startswith(PASSED) and callers.get(at) in places:  # the layer's line, not ops.dot's
            at = callers[at]
        frames[frame] = places[at]
    return frames


def _source(frames: dict[str, str], line: str, body: list[str] = ()) -> str:
    """Where an instruction comes from: its own stack frame, else the first of its body's."""
    for text in (line, *body):
        if (frame := _FRAME.search(text)) and frame.group(1) in frames:
            return frames[frame.group(1)]
    return ""


def operations(text: str) -> list[Operation]:
    """Every top-level operation of one run of the program with the bytes it moves: each reads
    its operands and writes its result (a fusion as its body sees them), once per loop
    iteration, as XLA's cost analysis counts them; what happens inside a fusion stays on chip."""
    bodies, entry = hlo.computations(text)
    frames, found = _stack_frames(text), []

    def visit(name: str, times: float) -> None:
        sizes, shapes = {}, {}
        for line, result, type_text, op, operands in hlo.instructions(bodies.get(name, ())):
            placed = hlo.device_memory_bytes(type_text)
            sizes[result] = size = sum(placed)
            shapes[result] = hlo.shape_of(type_text)
            called = bodies.get(m.group(1), ()) if (m := re.search(r"\bcalls=%?([\w.\-]+)", line)) else ()
            if op == "while":
                visit(hlo.BODY.search(line).group(1), times * hlo.trip_count(line, bodies, bodies[name]))
                continue
            if op in ("call", "conditional"):
                for callee in hlo.callees(line):
                    visit(callee, times * hlo.share(line, callee))
                continue
            if op == "fusion":
                moved = _accesses(called, bodies, [sizes.get(o, 0) for o in operands], placed)
            elif op.endswith("-start"):
                moved = _async_start(op, type_text, [sizes.get(o, 0) for o in operands])
            elif op.endswith("-done"):
                moved = 0
            elif op in _SLICES:
                moved = 2 * size
            elif op == "ragged-all-to-all":  # reads the rows it sends, writes as many: not its room
                moved = 2 * min(size, sizes.get(operands[0], size))
            elif op == "dynamic-update-slice":
                moved = 2 * sizes.get(operands[1], 0)
            elif op in _NO_TRAFFIC or (op == "custom-call" and _ALLOCATION.search(line)):
                moved = 0
            elif op == "custom-call" and _kernel_cost(line):
                moved = _kernel_cost(line)[1]
            else:
                moved = size + sum(sizes.get(o, 0) for o in operands)
            flops = _computation_flops(called) if op == "fusion" else _flops(line, op, operands, result, shapes)
            if moved or flops:
                shape = type_text.strip()
                found.append(Operation(result, op, shape, _source(frames, line, called), moved * times, flops * times))

    visit(entry, 1)
    return found


def memory_traffic(text: str) -> int:
    """Bytes of device memory one run of the program reads and writes (see `operations`)."""
    return sum(o.bytes for o in operations(text))


def top(found: list[Operation], n: int, by: str) -> list[Operation]:
    """The n operations that move the most bytes (by="bytes") or do the most FLOPs (by="flops")."""
    return sorted((o for o in found if getattr(o, by)), key=lambda o: -getattr(o, by))[:n]
