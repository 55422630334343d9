"""Goodput: the share of a run's wall time spent on steps that moved training forward, and where
the rest went.

One clock runs from the start of `train` and is always charging one part, so the parts add up to
the wall time: `startup` while the run starts (devices, mesh, data, the initial state), `data`
while the loop waits for its next batch, `eval` and `checkpoint` during evaluations, saves,
restores and the last writes, `other` for profiler traces and the time after the last step, and
the steps themselves. A step's time (from its batch in hand to the next wait for data) is charged
once the step is over: `compile` for a run's first step (and the ahead-of-time compile before
it), `lost` for a step that a run before this resume had already logged (recomputed work),
`skipped` for a step whose loss or gradient was not finite, else `productive`.

Steps run ahead of the host (JAX dispatches them asynchronously); the loop waits for the step
before the current one every step (the divergence hook reads its flag), and evaluations and saves
first wait for the step before them, so each part holds the device time it caused.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import jax

from podtrain.train.trainer import StepEnd

BADPUT = {
    "compile": "compile",
    "checkpoint": "checkpoint",
    "eval": "eval",
    "data": "data",
    "skipped": "skipped steps",
    "lost": "lost after resume",
    "startup": "startup",
    "other": "other",
}


class Goodput:
    def __init__(self):
        self.mark = self.start = time.perf_counter()
        self.seconds = dict.fromkeys(("productive", *BADPUT), 0.0)
        self.counts = dict.fromkeys(("productive", "skipped", "lost"), 0)
        self.current, self.in_step = "startup", 0.0  # what the clock charges; the step in progress's seconds
        self.pending: tuple | None = None  # the last step: (done, seconds, skipped flag on device)
        self.first, self.logged_past = 1, 0

    def _switch(self, part: str) -> str:
        now = time.perf_counter()
        if self.current == "step":
            self.in_step += now - self.mark
        else:
            self.seconds[self.current] += now - self.mark
        self.mark, previous, self.current = now, self.current, part
        return previous

    @contextmanager
    def charge(self, part: str):
        """Charge the time inside the block to `part`, then go back to what was charged before."""
        previous = self._switch(part)
        try:
            yield
        finally:
            self._switch(previous)

    def steps(self, start: int, logged_past: int, batches: Iterable) -> Iterator:
        """The batches of steps start+1.., each one's wait charged to data, the time between to
        its step; steps up to `logged_past` were logged before this resume, so are lost work."""
        self.first, self.logged_past = start + 1, logged_past
        self._switch("step")
        batches = iter(batches)
        while True:
            with self.charge("data"):
                batch = next(batches, None)
            if batch is None:
                return
            yield batch

    def after_step(self, end: StepEnd) -> None:
        """A hook, the last of every step: charge the step's time; its skipped flag is read a
        step late, when the divergence hook has already waited for it."""
        self._switch("step")
        self._settle()
        self.pending, self.in_step = (end.done, self.in_step, end.metrics["skipped"]), 0.0

    def _settle(self) -> None:
        if self.pending is None:
            return
        done, seconds, skipped = self.pending
        if done <= self.logged_past:
            part = "lost"
        else:
            part = "skipped" if bool(jax.device_get(skipped)) else "productive"
        self.counts[part] += 1
        self.seconds["compile" if done == self.first else part] += seconds  # a first step's time is its compile's
        self.pending = None

    def report(self) -> dict:
        """Seconds of each part and the productive share of the wall time so far, with the steps
        counted; time since the last step's hook is `other`."""
        self._switch("other")
        self.seconds["other"] += self.in_step
        self.in_step = 0.0
        self._settle()
        wall = self.mark - self.start
        record = {"wall_s": wall, "goodput": self.seconds["productive"] / wall}
        record.update({f"{part}_s": s for part, s in self.seconds.items()})
        record.update({f"{part}_steps": n for part, n in self.counts.items()})
        return record


def summary(record: dict) -> str:
    """'goodput 91.4%: compile 3.1%, checkpoint 2.2%, ...', the parts besides the steps by size."""
    wall = record["wall_s"]
    parts = sorted(((record[f"{p}_s"] / wall, label) for p, label in BADPUT.items()), reverse=True)
    rest = ", ".join(f"{label} {share:.1%}" for share, label in parts if share >= 0.0005)
    return f"goodput {record['goodput']:.1%} of {wall:.1f} s: {rest}"
