"""Training curves as a PNG: loss and val_loss, learning rate, tokens/s, (for puzzles) held-out
accuracy and the scores of eval.tasks (eval/TASK/METRIC) against step."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure  # not pyplot: a notebook's own backend stays as it is

from podtrain import storage
from podtrain.errors import DataError
from podtrain.train.metrics import read_metrics

PANELS = (
    ("loss", "loss (nats/token)"),
    ("lr", "learning rate"),
    ("tokens_per_sec", "tokens/s"),
    ("val_cell_accuracy", "held-out cell accuracy"),
    ("eval/", "task scores (eval.tasks)"),  # every eval/TASK/METRIC
)


def _series(records: list[dict], key: str) -> tuple[list, list]:
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [s for s, _ in points], [v for _, v in points]


def _keys(records: list[dict], key: str) -> list[str]:
    """`key`, or for a prefix ending in "/" every metric under it."""
    if not key.endswith("/"):
        return [key]
    return sorted({k for r in records for k in r if k.startswith(key) and not k.endswith("_stderr")})


def plot_runs(run_dirs: list[str], out: str | None = None) -> Path:
    runs = {d: read_metrics(d) for d in run_dirs}
    for d, records in runs.items():
        if not records:
            raise DataError(f"{d} has no metrics.jsonl with records; give the run_dir of a `podtrain train` run.")
    panels = [
        (key, title)
        for key, title in PANELS
        if any(_series(records, k)[0] for records in runs.values() for k in _keys(records, key))
    ]
    fig = Figure(figsize=(5 * len(panels), 4))
    axes = fig.subplots(1, len(panels), squeeze=False)
    for (key, title), ax in zip(panels, axes[0]):
        for d, records in runs.items():
            name = storage.path(d).name
            for k in _keys(records, key):
                label = f"{name} train" if key == "loss" else name if k == key else f"{name} {k.removeprefix(key)}"
                ax.plot(*_series(records, k), "o-" if k != key else "-", label=label)
            if key == "loss":
                ax.plot(*_series(records, "val_loss"), "o--", label=f"{name} val")
            if key == "val_cell_accuracy":
                ax.plot(*_series(records, "val_exact_accuracy"), "o--", label=f"{name} exact")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = storage.path(out) if out else storage.path(run_dirs[0]) / "curves.png"
    with path.open("wb") as f:
        fig.savefig(f, format="png", dpi=100)
    return path
