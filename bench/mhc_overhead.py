"""mHC against Llama of the same width and depth: val loss after the same steps, and step time.

    python bench/mhc_vs_llama.py [key=value ...]     # e.g. train.steps=100

Trains configs/tiny.yaml and configs/mhc_tiny.yaml one after the other on this machine with the
same overrides, then prints both final val losses and the mean step time of each (compilation,
eval and checkpoint saving excluded) with the ratio mhc / llama.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

from podtrain.config.load import load_config
from podtrain.train.loop import train
from podtrain.train.metrics import read_metrics

CONFIGS = Path(__file__).parent.parent / "configs"


def run(recipe: str, run_dir: Path, overrides: list[str]) -> tuple[float, float]:
    """Final val loss and mean step time of one recipe."""
    last = train(load_config(CONFIGS / recipe, [*overrides, f"run_dir={run_dir}", "train.sample_tokens=0"]))
    return last["val_loss"], statistics.mean(r["step_time"] for r in read_metrics(run_dir) if r.get("step_time"))


def main() -> None:
    overrides = sys.argv[1:]
    with tempfile.TemporaryDirectory() as tmp:
        llama = run("tiny.yaml", Path(tmp, "llama"), overrides)
        mhc = run("mhc_tiny.yaml", Path(tmp, "mhc"), overrides)
    print(f"{'model':<8}{'val_loss':>10}{'ms/step':>10}")
    for name, (loss, step) in (("llama", llama), ("mhc", mhc)):
        print(f"{name:<8}{loss:>10.4f}{step * 1e3:>10.1f}")
    print(f"step time mhc / llama: {mhc[1] / llama[1]:.3f}; val loss mhc - llama: {mhc[0] - llama[0]:+.4f}")


if __name__ == "__main__":
    main()
