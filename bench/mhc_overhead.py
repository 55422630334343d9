"""mHC's cost against the Llama of the same width and depth: step time, alternated in one process.

    python bench/mhc_overhead.py [--steps 30] [--repeats 2] [key=value ...]

Trains configs/tiny.yaml and configs/mhc_tiny.yaml with the same overrides, alternating them
(llama, mhc, llama, mhc, ... `--repeats` pairs) in one process, and prints each run's median step
time (the metrics' step_time: compilation, eval and checkpoint saves excluded) and final loss,
then the ratio mhc / llama of the pairs as min / median / max. Evaluation, checkpoints and the
closing sample are switched off; the compilation cache is left as configured, so each run
compiles (or loads) its step once before its timed steps.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from podtrain.program.load import load_config
from podtrain.train.loop import train
from podtrain.train.metrics import read_metrics

CONFIGS = Path(__file__).parent.parent / "configs"
RECIPES = {"llama": "tiny.yaml", "mhc": "mhc_tiny.yaml"}


def run(recipe: str, run_dir: Path, steps: int, overrides: list[str]) -> tuple[float, float]:
    """(median step time in seconds, last logged loss) of one training run."""
    cfg = load_config(
        CONFIGS / recipe,
        [
            f"train.steps={steps}",
            "train.log_every=1",
            f"train.eval_every={steps + 1}",
            f"checkpoint.every={steps + 1}",
            "train.sample_tokens=0",
            *overrides,
            f"run_dir={run_dir}",
        ],
    )
    train(cfg)
    rows = [r for r in read_metrics(run_dir) if r.get("step_time")]
    return statistics.median(r["step_time"] for r in rows), rows[-1]["loss"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2, help="llama/mhc pairs, alternated")
    parser.add_argument("overrides", nargs="*", help="key=value for both recipes")
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in RECIPES}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for name, recipe in RECIPES.items():
                step, loss = run(recipe, Path(tmp, f"{name}{i}"), args.steps, args.overrides)
                times[name].append(step)
                print(f"repeat {i} {name:<6} median step {step * 1e3:8.1f} ms   loss {loss:.4f}", flush=True)
    ratios = sorted(m / ll for ll, m in zip(times["llama"], times["mhc"]))
    print(
        f"step time mhc / llama over {args.repeats} pairs: min {ratios[0]:.3f}  "
        f"median {statistics.median(ratios):.3f}  max {ratios[-1]:.3f}"
    )


if __name__ == "__main__":
    main()
