"""Metrics to the sinks of `log.to` (podtrain.program.sinks), written by process 0 only:
RUN_DIR/metrics.jsonl, TensorBoard events in RUN_DIR, and Weights & Biases.

In a bucket, where an object cannot be appended to, these files are written in a local folder
and copied to RUN_DIR every few seconds, at each checkpoint and at the end (podtrain.storage.Mirror).

A resumed run continues the record of the step it resumed from: metrics.jsonl is rewritten
without the lines past that step (logged before the run stopped, and about to be logged again),
and TensorBoard is told to purge its events past it, so every step appears once. The last step
logged before (`logged_past`) tells goodput how many steps the resume computes again.

What faults cost is kept too: a run that resumes after a restart by `podtrain launch` (which sets
PODTRAIN_RESTART) or with steps to do again writes {"step", "restarts", "recomputed_steps"} at the
step it resumed from, both counted over the run's life.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from podtrain import storage
from podtrain.config.schema import Config
from podtrain.program.sinks import METRICS_FILE, SINKS, Start


class MetricsLog:
    def __init__(self, cfg: Config, start_step: int = 0, enabled: bool = True):
        self.sinks: list = []
        self.mirror = None
        self.logged_past = start_step  # the last step logged before this run resumed at start_step
        if not enabled:
            return
        self.mirror = storage.Mirror(cfg.run_dir, fetch=(METRICS_FILE, "wandb_id"))
        run_dir = self.mirror.local
        lines = _records(run_dir / METRICS_FILE)
        records = [json.loads(line) for line in lines]
        self.logged_past = max([start_step, *(r["step"] for r in records)])
        kept = [line for line, r in zip(lines, records) if r["step"] <= start_step]
        start = Start(run_dir, cfg, start_step, kept)
        self.sinks = [SINKS[name].open(start) for name in dict.fromkeys(cfg.log.to)]
        self._count_faults(records, start_step)

    def _count_faults(self, records: list[dict], start_step: int) -> None:
        """The restarts and recomputed steps so far, with this start's, where it is a restart or redoes steps."""
        restarted = int(os.environ.get("PODTRAIN_RESTART", "0")) > 0
        redone = self.logged_past - start_step
        if restarted or redone > 0:
            before = [r for r in records if "restarts" in r]
            self.write(
                {
                    "step": start_step,
                    "restarts": max((r["restarts"] for r in before), default=0) + restarted,
                    "recomputed_steps": max((r["recomputed_steps"] for r in before), default=0) + redone,
                },
                prefix="faults",
            )

    def write(self, record: dict, prefix: str = "train") -> None:
        record = {
            k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()
        }  # strict JSON
        for sink in self.sinks:
            sink.write(record, prefix)
        if self.mirror:
            self.mirror.sync()

    def flush(self) -> None:
        """Every record so far in RUN_DIR, at once (each checkpoint's step)."""
        if self.mirror:
            self.mirror.sync(force=True)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        if self.mirror:
            self.mirror.close()


def _records(path: Path) -> list[str]:
    """The complete lines of a metrics file; a run killed mid-write may have left half of one."""
    lines = path.read_text().splitlines(keepends=True) if path.exists() else []
    return [line for line in lines if line.endswith("\n") and _parses(line)]


def _parses(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except json.JSONDecodeError:
        return False


def read_metrics(run_dir: str | Path) -> list[dict]:
    return [json.loads(line) for line in _records(storage.path(run_dir) / METRICS_FILE)]
