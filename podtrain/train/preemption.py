"""Stopping when asked: SIGTERM (a preempted TPU VM, SLURM's time limit or scancel, `kill`) or
SIGINT (Ctrl-C) let the step in flight finish; every process then stops after the same step,
saves one last checkpoint and exits with errors.Preempted's code, 75. A second Ctrl-C exits at once.

In a multi-process job the agreement on that step is JAX's preemption sync point: the
coordination service's notifier catches SIGTERM on any process and tells the others, and
`reached_preemption_sync_point(step)` turns true on every process at the same step. SIGINT is
handed to the same notifier. A single process needs no agreement and catches both signals itself.
"""

from __future__ import annotations

import os
import signal
import sys

import jax
from jax.experimental import multihost_utils


class StopRequests:
    """Within `with`: the signals above are caught; `reached(step)` says whether to stop after `step`."""

    def __init__(self):
        self.received: signal.Signals | None = None
        self.shared = jax.distributed.is_initialized()  # JAX's notifier owns SIGTERM
        self.previous: dict = {}

    def __enter__(self):
        caught = (signal.SIGINT,) if self.shared else (signal.SIGINT, signal.SIGTERM)
        self.previous = {s: signal.signal(s, self._handle) for s in caught}
        return self

    def __exit__(self, *_):
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def _handle(self, signum, _frame) -> None:
        if self.received is not None:
            os._exit(128 + signum)  # asked twice: leave now; the last complete checkpoint stays
        self.received = signal.Signals(signum)
        print(
            f"\n[podtrain] {self.received.name}: stopping after this step and saving a "
            "checkpoint; send it again to exit at once.",
            file=sys.stderr,
            flush=True,
        )
        if self.shared:
            os.kill(os.getpid(), signal.SIGTERM)  # to JAX's notifier, which tells the other processes

    def reached(self, step: int) -> bool:
        if self.shared:  # called at every step by every process, as the sync point requires
            return multihost_utils.reached_preemption_sync_point(step)
        return self.received is not None
