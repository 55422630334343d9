"""Metrics to RUN_DIR/metrics.jsonl and TensorBoard events, written by process 0 only.

A resumed run continues the record of the step it resumed from: metrics.jsonl is rewritten
without the lines past that step (logged before the run stopped, and about to be logged again),
and TensorBoard is told to purge its events past it, so every step appears once.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path


def _summary_writer(**kwargs):
    """tensorboardX's SummaryWriter, imported without torch: tensorboardX imports torch wherever it
    is installed, only to accept its tensors (podtrain logs floats), and that costs every process
    seconds at start."""
    hidden = "torch" not in sys.modules
    if hidden:
        sys.modules["torch"] = None  # makes `import torch` raise ImportError, which tensorboardX expects
    try:
        from tensorboardX import SummaryWriter
    finally:
        if hidden:
            del sys.modules["torch"]
    return SummaryWriter(**kwargs)


class MetricsLog:
    def __init__(self, run_dir: Path, start_step: int = 0, enabled: bool = True):
        self.enabled = enabled
        if enabled:
            path = Path(run_dir) / "metrics.jsonl"
            kept = [line for line in _records(path) if json.loads(line)["step"] <= start_step]
            path.write_text("".join(kept))
            self.jsonl = open(path, "a")  # noqa: SIM115 - held open for the run, closed by close()
            self.tb = _summary_writer(logdir=str(run_dir), purge_step=start_step)

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
