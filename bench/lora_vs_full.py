"""LoRA against full fine-tuning of the same model in this process: trained parameters, the step's
state memory, the compiled step's matmul FLOPs and its wall time.

checkpoint_stall.py's ~50M-parameter Llama (random weights: a step costs the same whatever they
are), its full step and its LoRA step (rank 8 on every attention and MLP projection) run
alternately; the step time is the median over the repeats. The frozen base gets no weight
gradient, so the LoRA step's matmuls are about 2/3 of the full step's. Ratios are the signal;
absolute times on a shared machine are noise.

    .venv/bin/python bench/lora_vs_full.py [--steps 8] [--repeats 3] [--rank 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
from podtrain.planning import cost
from podtrain.program.job import build
from podtrain.program.load import load_config
from podtrain.program.memory import measure
from podtrain.program.prepare import final
from podtrain.runtime.mesh import build_mesh

from checkpoint_stall import MODEL, TRAIN

BATCH = ["train.batch_size=8"]  # more rows than checkpoint_stall's 2: the matmuls, not the dispatch, make the step


def seconds_per_step(job, steps: int) -> float:
    state = job.init_state(0)  # LoRA: a random base; the step donates its input, so each run starts its own
    state, _ = job.step(state, job.task.batches[0])  # compiled outside the timing
    jax.block_until_ready(state)
    start = time.perf_counter()
    for i in range(steps):
        state, _ = job.step(state, job.task.batches[i])
    jax.block_until_ready(state)
    return (time.perf_counter() - start) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rank", type=int, default=8)
    args = p.parse_args()
    jobs = {}
    for name, extra in (("full", []), ("lora", [f"train.lora.rank={args.rank}", "train.init_from=random"])):
        cfg = load_config(None, MODEL + TRAIN + BATCH + extra)
        mesh = build_mesh(cfg.mesh, jax.devices()[:1])
        jobs[name] = build(final(cfg, "cpu", mesh), mesh)
    times = {name: [] for name in jobs}
    for _ in range(args.repeats):
        for name, job in jobs.items():
            times[name].append(seconds_per_step(job, args.steps))
    rows = {}
    for name, job in jobs.items():
        trained = sum(s.size for s in jax.tree.leaves(job.abstract_state["params"]))
        memory, compiled = measure(job, float("inf"))
        rows[name] = (
            trained,
            memory.params + memory.optimizer + memory.gradients,
            cost.matmul_flops(compiled.as_text()),
        )
        print(
            f"{name:5}  trained {trained / 1e6:8.3f}M  state {rows[name][1] / 2**20:7.1f} MiB  "
            f"matmul FLOPs {rows[name][2]:.3e}  step {statistics.median(times[name]) * 1e3:7.1f} ms"
        )
    (tf, sf, ff), (tl, sl, fl) = rows["full"], rows["lora"]
    speed = statistics.median(times["full"]) / statistics.median(times["lora"])
    print(
        f"lora/full: trained {tl / tf:.4f}, state {sl / sf:.3f}, matmul FLOPs {fl / ff:.3f}; {speed:.2f}x the steps/s"
    )


if __name__ == "__main__":
    main()
