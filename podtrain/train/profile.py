"""Profiles: a jax.profiler trace of chosen steps, and the XLA ops that took the longest in one.

`train.profile_steps=[START, END]` traces steps START to END of a run (process 0's devices) into
RUN_DIR/profile/plugins/profile/<time>/: HOST.xplane.pb for TensorBoard's profile plugin
(`tensorboard --logdir RUN_DIR/profile`) and perfetto_trace.json.gz for ui.perfetto.dev. The
steps before and after are waited for, so the trace holds those steps and nothing else; a trace
that starts at a run's first step holds its compilation too.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path

import jax
from jax.profiler import ProfileData

from podtrain import storage
from podtrain.train.goodput import Goodput
from podtrain.train.trainer import StepEnd


class Trace:
    """A hook tracing steps first..last into `folder` (local, or a bucket's: traced into a local
    folder and copied there when the trace ends); starting and stopping it is charged as `other`."""

    def __init__(self, folder: str, first: int, last: int, start: int, goodput: Goodput):
        self.out, self.first, self.last, self.goodput = folder, first, last, goodput
        self.folder = Path(tempfile.mkdtemp(prefix="podtrain-trace-")) if storage.is_remote(folder) else Path(folder)
        self.on = False
        if first <= start + 1 <= last:  # the trace covers this run's first step
            self._begin()

    def _begin(self) -> None:
        with self.goodput.charge("other"):
            jax.profiler.start_trace(str(self.folder), create_perfetto_trace=True)
        self.on = True

    def after_step(self, end: StepEnd) -> None:
        if not self.on and end.done == self.first - 1:
            jax.block_until_ready(end.state)
            self._begin()
        elif self.on and end.done in (self.last, end.last):
            jax.block_until_ready(end.state)
            with self.goodput.charge("other"):
                jax.profiler.stop_trace()
                if storage.is_remote(self.out):
                    storage.upload(self.folder, self.out)
            self.on = False


def newest_trace(folder: Path) -> Path:
    """The folder of the newest trace under a profile folder (one xplane.pb per host in it)."""
    traces = sorted(p.parent for p in Path(folder).glob("plugins/profile/*/*.xplane.pb"))
    if not traces:
        raise FileNotFoundError(f"no trace (*.xplane.pb) under {folder}")
    return traces[-1]


def ops_by_time(trace: Path) -> list[tuple[str, float, int]]:
    """(op, seconds, times run) of the XLA ops in a trace, summed over its devices, longest first.
    A TPU lists its ops on the device's "XLA Ops" line; a GPU without that line its kernels, one
    line per stream; the CPU runtime marks each op it runs on a host thread with an `hlo_op` stat.
    An op's time is its own: a loop's excludes the ops of its body, listed themselves. Kernels do
    not nest, and each counts in full: one launched before the last ends (programmatic dependent
    launch) overlaps it, it is not inside it."""
    time, runs = {True: Counter(), False: Counter()}, {True: Counter(), False: Counter()}  # by on_device
    for path in sorted(trace.glob("*.xplane.pb")):
        for plane in ProfileData.from_file(str(path)).planes:
            device = plane.name.startswith("/device:")
            has_ops_line = any(line.name == "XLA Ops" for line in plane.lines)
            for line in plane.lines:
                kernels = device and not has_ops_line and line.name.startswith("Stream")
                on_device = (device and line.name == "XLA Ops") or kernels
                ops = [
                    (e.name, e.start_ns, e.duration_ns)
                    for e in line.events
                    if on_device or any(stat == "hlo_op" for stat, _ in e.stats)
                ]
                for name, ns in ((name, ns) for name, _, ns in ops) if kernels else _self_times(ops):
                    time[on_device][name] += ns
                    runs[on_device][name] += 1
    on_device = bool(time[True])
    return [(name, ns / 1e9, runs[on_device][name]) for name, ns in time[on_device].most_common()]


def _self_times(ops: list[tuple[str, float, float]]):
    """(name, duration less that of the ops nested in it) of one line's (name, start, duration)."""
    open_ops: list[list] = []  # [end, name, duration, nested duration], outermost first

    def close():
        _, name, duration, nested = open_ops.pop()
        return name, duration - nested

    for name, start, duration in sorted(ops, key=lambda op: (op[1], -op[2])):
        while open_ops and open_ops[-1][0] <= start:
            yield close()
        if open_ops:
            open_ops[-1][3] += duration
        open_ops.append([start + duration, name, duration, 0.0])
    while open_ops:
        yield close()
