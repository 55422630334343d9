"""configs/moe_tiny.yaml against configs/tiny.yaml: held-out loss at the same steps and tokens.

    python bench/moe_vs_dense.py [key=value ...]

Trains both recipes as shipped (200 steps each, same data and seed; overrides apply to both),
each in a process of its own, and prints each run's validation loss at every evaluation, its
tokens/s and, for the MoE, the share of token copies its capacity dropped; then the difference
moe - dense at the last evaluation (below 0: the MoE wins). Both use the same weights per token
(2 experts of half the dense MLP's width).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from podtrain.train.metrics import read_metrics

CONFIGS = Path(__file__).parent.parent / "configs"
RECIPES = {"dense": "tiny.yaml", "moe": "moe_tiny.yaml"}


def run(recipe: str, run_dir: Path, overrides: list[str]) -> list[dict]:
    command = [sys.executable, "-m", "podtrain", "train", str(CONFIGS / recipe), *overrides]
    subprocess.run([*command, "train.sample_tokens=0", f"run_dir={run_dir}"], check=True, capture_output=True)
    return read_metrics(run_dir)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    last = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, recipe in RECIPES.items():
            records = run(recipe, Path(tmp) / name, args.overrides)
            evals = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
            steps = [r for r in records if "tokens_per_sec" in r]
            dropped = [r["dropped"] for r in steps if "dropped" in r]
            print(
                f"{name:>5} ({recipe}): val_loss "
                + ", ".join(f"{v:.4f} at step {s}" for s, v in evals)
                + f"; {steps[-1]['tokens_per_sec']:,.0f} tokens/s"
                + (f"; {dropped[-1]:.1%} of copies dropped at the end" if dropped else "")
            )
            last[name] = evals[-1][1]
    print(f"moe - dense at the last evaluation: {last['moe'] - last['dense']:+.4f}")


if __name__ == "__main__":
    main()
