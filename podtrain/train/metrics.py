"""Metrics to RUN_DIR/metrics.jsonl and TensorBoard events, written by process 0 only.

A resumed run continues the record of the step it resumed from: metrics.jsonl is rewritten
without the lines past that step (logged before the run stopped, and about to be logged again),
and TensorBoard is told to purge its events past it, so every step appears once.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from tensorboardX import SummaryWriter


class MetricsLog:
    def __init__(self, run_dir: Path, start_step: int = 0, enabled: bool = True):
        self.enabled = enabled
        if enabled:
            path = Path(run_dir) / "metrics.jsonl"
            kept = [line for line in path.read_text().splitlines(keepends=True) if line.strip() and json.loads(line)["step"] <= start_step] if path.exists() else []
            path.write_text("".join(kept))
            self.jsonl = open(path, "a")
            self.tb = SummaryWriter(logdir=str(run_dir), purge_step=start_step)

    def write(self, record: dict, prefix: str = "train") -> None:
        if not self.enabled:
            return
        record = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}  # strict JSON
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


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
