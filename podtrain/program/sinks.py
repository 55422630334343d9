"""Where metrics go, by `log.to` (`SINKS`): RUN_DIR/metrics.jsonl, TensorBoard events in RUN_DIR,
Weights & Biases. Each sink is opened at the step a run starts from (`Start`) and takes each record
with its prefix (train, eval, goodput, ...); `podtrain.train.metrics` writes to those of log.to.

W&B: one W&B run per run directory, continued on resume. The W&B run id is kept in
RUN_DIR/wandb_id, so a resumed run logs into the same W&B run. Each record goes with its step as
the `step` metric, the x-axis of every chart: a resumed run logs again the steps past its
checkpoint, which W&B's own step counter (only ever increasing) would drop. With
WANDB_MODE=offline the run's files stay in RUN_DIR/wandb, for `wandb sync` later.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from podtrain import storage
from podtrain.config.schema import Config

METRICS_FILE = "metrics.jsonl"  # the jsonl sink's file in RUN_DIR


class Start(NamedTuple):
    """Where a run's metrics begin: the run directory (a local folder), the config, the step the
    run starts from and the lines of metrics.jsonl up to that step."""

    run_dir: Path
    cfg: Config
    step: int
    kept: list[str]


class Jsonl:
    def __init__(self, start: Start):
        path = start.run_dir / METRICS_FILE
        path.write_text("".join(start.kept))
        self.file = open(path, "a")  # noqa: SIM115 - held open for the run, closed by close()

    def write(self, record: dict, prefix: str) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class TensorBoard:
    def __init__(self, start: Start):
        self.writer = _summary_writer(logdir=str(start.run_dir), purge_step=start.step)

    def write(self, record: dict, prefix: str) -> None:
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)):
                self.writer.add_scalar(f"{prefix}/{key}", value, record["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


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


def _name(run_dir: str) -> str:
    """The run directory's own name (of `.` too), the W&B run's default name."""
    return storage.path(run_dir).name if storage.is_remote(run_dir) else Path(run_dir).resolve().name


class WandbLog:
    def __init__(self, start: Start):
        import wandb  # the optional extra `wandb`: config validation refuses log.to=[wandb] without it

        run_dir, cfg = start.run_dir, start.cfg
        kept = run_dir / "wandb_id"
        run_id = kept.read_text().strip() if kept.is_file() else secrets.token_hex(4)
        run_dir.mkdir(parents=True, exist_ok=True)
        kept.write_text(run_id + "\n")
        log = cfg.log
        self.run = wandb.init(
            project=log.wandb_project,
            name=log.wandb_name or _name(cfg.run_dir),
            tags=log.wandb_tags,
            config=dataclasses.asdict(cfg),
            id=run_id,
            resume="allow",
            dir=str(run_dir),
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def write(self, record: dict, prefix: str) -> None:
        values = {f"{prefix}/{k}": v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        self.run.log({"step": record["step"], **values})

    def close(self) -> None:
        self.run.finish()


@dataclass(frozen=True)
class Sink:
    open: Callable[[Start], Any]  # -> the sink, with write(record, prefix) and close()
    extra: str = ""  # the optional extra it needs (pip install -e '.[EXTRA]'), which installs that module


# log.to's names -> their sinks
SINKS = {"jsonl": Sink(Jsonl), "tensorboard": Sink(TensorBoard), "wandb": Sink(WandbLog, extra="wandb")}
