"""Step time of one job as 2 processes x 4 devices against 1 process x 8 devices, on the same mesh.

    python bench/multihost_step.py [--steps 30] [key=value ...]

Both runs train the default model from scratch with the same config; the step time is the mean
of the `step_time` values in metrics.jsonl (compilation, eval and saving excluded). Also prints
how long each process took to join the coordinator. CPU: gloo carries the cross-process traffic.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from podtrain.train.metrics import read_metrics


def run(argv: list[str], devices: int) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    done = subprocess.run([sys.executable, "-m", "podtrain", *argv], env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(argv)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return done.stdout


def mean_step_time(run_dir: Path) -> float:
    return statistics.mean(r["step_time"] for r in read_metrics(run_dir) if r.get("step_time"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        common = [
            "device_type=cpu",
            "mesh.data=2",
            "mesh.fsdp=2",
            "mesh.tensor=2",
            f"train.steps={args.steps}",
            "train.log_every=10",
            "train.eval_every=100000",
            "train.eval_batches=1",
            "checkpoint.every=100000",
            "train.sample_tokens=0",
            *args.overrides,
        ]
        run(["train", *common, f"run_dir={tmp}/one"], devices=8)
        out = run(
            ["launch", "--nproc", "2", "--devices-per-proc", "4", "--", "train", *common, f"run_dir={tmp}/two"],
            devices=4,
        )
        one, two = mean_step_time(Path(tmp, "one")), mean_step_time(Path(tmp, "two"))
    joins = [float(s) for s in re.findall(r"joined \S+ in ([0-9.]+) s", out)]
    print(f"mesh data=2 fsdp=2 tensor=2, {args.steps} steps, {' '.join(args.overrides) or 'default model'}")
    print(f"1 process  x 8 devices: {one * 1e3:8.1f} ms/step")
    print(f"2 processes x 4 devices: {two * 1e3:8.1f} ms/step")
    print(f"ratio 2x4 / 1x8: {two / one:.2f}")
    print(f"jax.distributed join time per process: {', '.join(f'{j:.2f} s' for j in joins)}")


if __name__ == "__main__":
    main()
