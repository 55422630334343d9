"""Metrics to RUN_DIR/metrics.jsonl and TensorBoard events, written by process 0 only."""

from __future__ import annotations

import json
import math
from pathlib import Path

from tensorboardX import SummaryWriter


class MetricsLog:
    def __init__(self, run_dir: Path, enabled: bool = True):
        self.enabled = enabled
        if enabled:
            self.jsonl = open(Path(run_dir) / "metrics.jsonl", "a")
            self.tb = SummaryWriter(logdir=str(run_dir))

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
