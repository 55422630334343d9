"""Reading a compiled program's optimized HLO text: its computations and instructions, loop trip
counts, and the collectives it runs (`planning/cost.py` counts its FLOPs and bytes).

`collectives(compiled.as_text())` lists every collective instruction with how many times one
execution of the program runs it: an instruction inside a scanned layer stack (an HLO while
loop with a known trip count) counts once per layer. This is what the partitioner really
emitted, so it shows what each mesh axis costs; tests audit it and `plan` predicts from it.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "ragged-all-to-all", "all-to-all", "collective-permute")
DTYPE_BYTES = {"pred": 1, "bf16": 2} | {f"{kind}{bits}": bits // 8 for kind in "suf" for bits in (8, 16, 32, 64)}
DTYPE_BYTES |= dict.fromkeys(("f8e4m3fn", "f8e5m2", "f8e4m3", "f8e4m3fnuz", "f8e5m2fnuz", "f8e4m3b11fnuz"), 1)

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+(" + "|".join(KINDS) + r")(-start)?\(")
_ARRAY = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([\d,]*)\]")
# An array with its layout, whose S(n) names the memory it lives in: TPU's memory-space assignment
# puts buffers in on-chip memories (S(1) VMEM, and scalar spaces) beside device memory (no S).
_PLACED = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([\d,]*)\](\{[^}]*\})?")
_ON_CHIP = re.compile(r"S\([1-9]\d*\)")
_CALLEE = re.compile(r"\b(?:body|condition|to_apply|calls)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_BRANCH = re.compile(r"\b(?:true|false)_computation=%?([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")  # stack frames, after the header
BODY = re.compile(r"\bbody=%?([\w.\-]+)")
_COMMENT = re.compile(r"/\*.*?\*/")
_OPERATION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][\w\-]*)\(([^()]*)\)")
# Replica groups come as {{0,1},{2,3}}, as an iota [groups,size]<=[dims]T(perm), or as mesh axes:
# mesh['axis_0'=2,'axis_1'=4], device_ids=([2,4]T(1,0)) {'axis_0'}.
_GROUPS = re.compile(
    r"replica_groups=(\{\{[\d,{}]*\}\}"  # explicit groups
    r"|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?"  # an iota
    r"|mesh\[[^\]]*\](?:,\s*device_ids=\((?:[^()]|\([^()]*\))*\))?\s*\{[^}]*\})"  # mesh axes
)


_PAIRS = re.compile(r"source_target_pairs=(\{\{[\d,{}]*\}\})")  # a permute's (source, target) devices


@dataclass(frozen=True)
class Collective:
    kind: str  # one of KINDS
    shapes: tuple[tuple[int, ...], ...]  # the arrays it produces (a combined collective has several)
    dtype: str
    bytes: int  # of the whole arrays involved, once: all-gather's output, reduce-scatter's input; a
    # ragged all-to-all's rows sent or room received, the smaller (its buffers keep room for more)
    group_size: int | None  # devices in each replica group
    replica_groups: str
    count: int  # executions per run of the program (layers of a scan count each)
    computation: str  # the HLO computation it sits in

    @property
    def total_bytes(self) -> int:
        return self.bytes * self.count


def computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    """The instruction lines of each computation, and the entry computation's name."""
    bodies, name, entry = {}, None, None
    for line in hlo.splitlines():
        if line[:1].isdigit() or line.strip() in TABLES:  # the stack-frame tables (`_stack_frames`)
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


# A scalar integer constant (a loop's counter and bounds: s32 in a scan, u32 in the TPU's windowed
# einsums, which overlap an fsdp all-gather with its matmul in a loop over the shards).
_INTEGER_CONSTANT = re.compile(r"= [su](?:8|16|32|64)\[\][^ ]* constant\((\d+)\)")
_INDEX = re.compile(r"\bindex=(\d+)")


def _named(lines: list[str]) -> dict[str, tuple[str, list[str], str]]:
    """name -> (op, operand names, line) of a computation's instructions."""
    return {result: (op, operands, line) for line, result, _, op, operands in instructions(lines)}


def _integer(named: dict, name: str) -> int | None:
    """The value of an integer scalar constant, through copies of it; None for anything else."""
    while named.get(name, ("",))[0] == "copy":
        name = named[name][1][0]
    found = _INTEGER_CONSTANT.search(named[name][2]) if named.get(name, ("",))[0] == "constant" else None
    return int(found.group(1)) if found else None


def trip_count(loop: str, bodies: dict, caller: list[str] = ()) -> int:
    """A while loop's iterations: its known_trip_count (CPU, GPU), else (TPU's optimized HLO drops
    the annotation) from the loop itself: its condition `counter < bound`, the counter's step in
    the body (a scan counts 0..n-1 by 1, a windowed einsum its shards 2 at a time) and its start in
    the initial tuple, a constant of `caller` (the computation that runs the loop), else 0."""
    if known := _TRIP.search(loop):
        return int(known.group(1))
    called = dict(re.findall(r"\b(condition|body)=%?([\w.\-]+)", loop))
    condition = _named(bodies.get(called.get("condition"), ()))
    compare = next((d for d in condition.values() if d[0] == "compare" and "direction=LT" in d[2]), None)
    if compare is None or len(compare[1]) != 2:
        return 1
    counter, bound = condition.get(compare[1][0], ("",)), _integer(condition, compare[1][1])
    if counter[0] != "get-tuple-element" or bound is None:
        return 1
    index = int(_INDEX.search(counter[2]).group(1))
    body = _named(bodies.get(called.get("body"), ()))
    root = next((d for d in body.values() if d[2].lstrip().startswith("ROOT")), ("", [], ""))
    update = body.get(root[1][index], ("",)) if root[0] == "tuple" and index < len(root[1]) else ("",)
    step = next((v for o in update[1] if (v := _integer(body, o))), 1) if update[0] == "add" else 1
    init = re.search(r"\bwhile\(%?([\w.\-]+)\)", loop)
    named = _named(caller)
    start = named.get(init.group(1), ("",)) if init else ("",)
    first = (_integer(named, start[1][index]) if start[0] == "tuple" and index < len(start[1]) else None) or 0
    return max(0, -(-(bound - first) // step))


def callees(line: str) -> list[str]:
    """The computations an instruction calls: loop body and condition, branches, reducers, fusions."""
    return _CALLEE.findall(line) + _branches(line)


def _branches(line: str) -> list[str]:
    """The branches of a conditional instruction (none for any other)."""
    return _BRANCH.findall(line) + [c.strip().lstrip("%") for b in _BRANCHES.findall(line) for c in b.split(",")]


def share(line: str, callee: str) -> float:
    """Runs of `callee` per run of the instruction `line` that calls it, loops aside: one of a
    conditional's k branches runs, so each counts 1/k (exact where they cost the same)."""
    arms = _branches(line)
    return 1 / len(arms) if callee in arms else 1


def multipliers(bodies: dict, entry: str) -> dict[str, float]:
    """Times each computation runs per execution of the entry one, through calls, conditionals
    (`share`) and while loops."""
    times: dict[str, float] = defaultdict(int)

    def visit(name: str, n: float) -> None:
        times[name] += n
        for line in bodies.get(name, ()):
            body = BODY.search(line)
            for callee in callees(line):
                if callee in bodies:
                    loops = trip_count(line, bodies, bodies[name]) if body and callee == body.group(1) else 1
                    visit(callee, n * loops * share(line, callee))

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
    bodies, entry = computations(hlo)
    times = multipliers(bodies, entry)
    found = []
    for name, lines in bodies.items():
        if not times.get(name):
            continue
        types = {}  # the computation's results' types, read once a ragged all-to-all asks its operand's
        for line in lines:
            match = _INSTRUCTION.match(line)
            if not match:
                continue
            instruction, result, kind, started = match.groups()
            arrays = [(dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in _ARRAY.findall(result)]
            if started and kind in ("all-gather", "collective-permute"):
                # (inputs, outputs), then the TPU's scalar u32 contexts: the outputs are what moves
                arrays = [a for a in arrays if a[1]]
                arrays = arrays[len(arrays) // 2 :][:1] if kind == "collective-permute" else arrays[len(arrays) // 2 :]
            elif started and kind == "ragged-all-to-all":
                arrays = arrays[-1:]  # the GPU's ((its operands), output): the output buffer
            groups = _GROUPS.search(line) or _PAIRS.search(line)
            group_size = _group_size(groups.group(1)) if groups else None
            if group_size == 1:
                continue  # each device alone (a shard_map's sum over axes of size 1): nothing moves
            size = sum(DTYPE_BYTES[dtype] * math.prod(shape) for dtype, shape in arrays)
            if kind == "reduce-scatter":
                size *= group_size or 1
            elif kind == "ragged-all-to-all":
                types = types or {result: type_text for _, result, type_text, _, _ in instructions(lines)}
                size = min(size, _first_operand_bytes(line, types))
            elif kind == "all-reduce" and _sliced_by_root(lines, instruction):
                kind = "reduce-scatter"  # the TPU's all-reduce-scatter fusion: each device keeps its slice
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


def _first_operand_bytes(line: str, types: dict[str, str]) -> int:
    """Bytes of an instruction's first operand, by its name among its computation's result `types`."""
    operands = next(instructions([line]), (None, None, None, None, []))[4]
    return nbytes(types.get(operands[0], "")) if operands else 0


def megascale_sends(hlo: str) -> int:
    """Bytes one device sends per run to other TPU slices: a multi-slice program runs its
    collectives within each slice and hands what crosses slices to the Megascale runtime as host
    transfers (send and recv), each counted per loop iteration."""
    bodies, entry = computations(hlo)
    times = multipliers(bodies, entry)
    return sum(
        times.get(name, 0) * nbytes(elements(type_text)[0])
        for name, lines in bodies.items()
        for line, _, type_text, op, _ in instructions(lines)
        if op == "send" and "xla_megascale_runtime" in line
    )


def _sliced_by_root(lines: list[str], instruction: str) -> bool:
    """Whether a computation's lines return a dynamic slice of `instruction`."""
    root = next((line for line in lines if line.lstrip().startswith("ROOT ")), "")
    return bool(re.search(r"\sdynamic-slice\(%?" + re.escape(instruction) + r"[,)]", root))


def _devices_together(groups: str) -> list[int]:
    """The device ids of one replica group (or one permute's source and target), from any of the forms."""
    if groups.startswith("{{"):
        return [int(d) for d in groups[2:].split("}")[0].split(",")]
    if groups.startswith("["):  # an iota: [groups,size]<=[dims]T(perm)
        shape, tile = groups.split("<=")
        return _iota(tile).reshape(dims(shape.strip("[]")))[0].tolist()
    if groups.startswith("mesh"):  # mesh['axis_0'=2,...], device_ids=([dims]T(perm)) {'axis_0'}: one group
        sizes = [int(n) for n in re.findall(r"'axis_\d+'=(\d+)", groups.split("]")[0])]
        order = re.search(r"device_ids=\(([^()]*(?:\([^()]*\))?)\)", groups)
        ids = _iota(order.group(1)) if order else np.arange(math.prod(sizes))
        named = {int(i) for i in re.findall(r"'axis_(\d+)'", groups.rsplit("{", 1)[1])}
        return ids.reshape(sizes)[tuple(slice(None) if i in named else 0 for i in range(len(sizes)))].ravel().tolist()
    return []


def _iota(tile: str) -> np.ndarray:
    """The device ids of an iota tile, `[dims]` or `[dims]T(perm)`: 0, 1, ... laid out, then transposed."""
    shape = dims(re.search(r"\[([\d,]+)\]", tile).group(1))
    ids = np.arange(math.prod(shape)).reshape(shape)
    perm = re.search(r"T\(([\d,]+)\)", tile)
    return ids.transpose(dims(perm.group(1))) if perm else ids


def group(c: Collective) -> list[int]:
    """The device ids of one of a collective's replica groups (they are alike), counted through the mesh."""
    return _devices_together(c.replica_groups)


def mesh_axes(c: Collective, mesh: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes (sizes by name, in the mesh's order) along which a collective's devices
    differ: where its bytes travel. Device ids count through the mesh in its order."""
    ids = group(c)
    if len(ids) < 2:
        return ()
    coords = np.array(np.unravel_index(ids, tuple(mesh.values())))
    return tuple(axis for axis, row in zip(mesh, coords) if len(set(row)) > 1)


def by_axes(found: list[Collective], mesh: dict[str, int]) -> dict[str, int]:
    """Bytes per run of the program, by the mesh axes they travel along ('context', 'data+fsdp')."""
    totals: dict[str, int] = {}
    for c in found:
        name = "+".join(mesh_axes(c, mesh)) or "-"
        totals[name] = totals.get(name, 0) + c.total_bytes
    return totals


def summary(found: list[Collective]) -> dict[str, int]:
    """Bytes per run of the program, by kind."""
    totals = {kind: 0 for kind in KINDS}
    for c in found:
        totals[c.kind] += c.total_bytes
    return totals


def dims(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.split(",") if d)


def shape_of(type_text: str) -> tuple[int, ...]:
    arrays = _ARRAY.findall(type_text)
    return dims(arrays[0][1]) if len(arrays) == 1 else ()


def nbytes(type_text: str) -> int:
    return sum(DTYPE_BYTES[dtype] * math.prod(dims(shape)) for dtype, shape in _ARRAY.findall(type_text))


def device_memory_bytes(type_text: str) -> list[int]:
    """Bytes of each array of a type in device memory (HBM): 0 for one placed on chip."""
    return [
        0 if _ON_CHIP.search(layout) else DTYPE_BYTES[dtype] * math.prod(dims(shape))
        for dtype, shape, layout in _PLACED.findall(type_text)
    ]


def elements(type_text: str) -> list[str]:
    """The top-level elements of a tuple type, "(a, (b, c), d)" -> ["a", "(b, c)", "d"]; [type] for an array."""
    text = type_text.strip()
    if not text.startswith("("):
        return [text]
    parts, depth, start = [], 0, 1
    for i, c in enumerate(text[1:-1], 1):
        if c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    return [*parts, text[start:-1].strip()]


def instructions(lines: list[str]):
    """(line, result, its type, op, operand names) of each instruction line."""
    for line in lines:
        if match := _OPERATION.match(line):
            result, type_text, op, operands = match.groups()
            operands = _COMMENT.sub("", operands)  # long operand lists are numbered: /*index=5*/%name
            yield line, result, type_text, op, [o.strip().lstrip("%") for o in operands.split(",") if o.strip()]
