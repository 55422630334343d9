"""Metrics to Weights & Biases from process 0: one W&B run per run directory, continued on resume.

The W&B run id is kept in RUN_DIR/wandb_id, so a resumed run logs into the same W&B run. Each
record goes with its step as the `step` metric, the x-axis of every chart: a resumed run logs
again the steps past its checkpoint, which W&B's own step counter (only ever increasing) would
drop. With WANDB_MODE=offline the run's files stay in RUN_DIR/wandb, for `wandb sync` later.
"""

from __future__ import annotations

import dataclasses
import secrets
from pathlib import Path

from podtrain import storage
from podtrain.config.schema import Config


def _name(run_dir: str) -> str:
    """The run directory's own name (of `.` too), the W&B run's default name."""
    return storage.path(run_dir).name if storage.is_remote(run_dir) else Path(run_dir).resolve().name


class WandbLog:
    def __init__(self, run_dir: Path, cfg: Config):
        import wandb  # the optional extra `wandb`: config validation refuses log.to=[wandb] without it

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
