"""Metrics to RUN_DIR/metrics.jsonl and TensorBoard events, written by process 0 only.

A resumed run continues the record of the step it resumed from: metrics.jsonl is rewritten
without the lines past that step (logged before the run stopped, and about to be logged again),
and TensorBoard is told to purge its events past it, so every step appears once.

What faults cost is kept too: a run that resumes after a restart by `podtrain launch` (which sets
PODTRAIN_RESTART) or with steps to do again writes {"step", "restarts", "recomputed_steps"} at the
step it resumed from, both counted over the run's life: automatic restarts, and the steps logged
before a stop past the checkpoint it resumed from.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from tensorboardX import SummaryWriter


class MetricsLog:
    def __init__(self, run_dir: Path, start_step: int = 0, enabled: bool = True):
        self.enabled = enabled
        if enabled:
            path = Path(run_dir) / "metrics.jsonl"
            lines = _records(path)
            records = [json.loads(line) for line in lines]
            path.write_text("".join(line for line, r in zip(lines, records) if r["step"] <= start_step))
            self.jsonl = open(path, "a")  # noqa: SIM115 - held open for the run, closed by close()
            self.tb = SummaryWriter(logdir=str(run_dir), purge_step=start_step)
            self._count_faults(records, start_step)

    def _count_faults(self, records: list[dict], start_step: int) -> None:
        """The restarts and recomputed steps so far, with this start's, where it is a restart or redoes steps."""
        restarted = int(os.environ.get("PODTRAIN_RESTART", "0")) > 0
        redone = max((r["step"] for r in records), default=start_step) - start_step
        if restarted or redone > 0:
            before = [r for r in records if "restarts" in r]
            self.write(
                {
                    "step": start_step,
                    "restarts": max((r["restarts"] for r in before), default=0) + restarted,
                    "recomputed_steps": max((r["recomputed_steps"] for r in before), default=0) + max(redone, 0),
                },
                prefix="faults",
            )

    def write(self, record: dict, prefix: str = "train") -> None:
        if not self.enabled:
            return
        record = {
            k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()
        }  # strict JSON
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)):
                self.tb.add_scalar(f"{prefix}/{key}", value, record["step"])
        self.tb.flush()

    def close(self) -> None:
        if self.enabled:
            self.jsonl.close()
            self.tb.close()


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
    return [json.loads(line) for line in _records(Path(run_dir) / "metrics.jsonl")]
