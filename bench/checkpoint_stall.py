"""How long a checkpoint holds up training: async against synchronous saves, and the restore.

Runs the same steps of a ~50M-parameter Llama in this process without saving, with a synchronous
save every K steps, and with an async save every K steps, alternating the three. A save's stall
is the extra wall time of its runs (median) over the runs without saves, per save; the restore
is timed with its checksum verification. Ratios are the signal; absolute times on a shared machine are noise.

    .venv/bin/python bench/checkpoint_stall.py [--steps 12] [--every 3] [--repeats 2]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import jax
from podtrain.program.job import build
from podtrain.program.load import load_config
from podtrain.runtime.mesh import build_mesh
from podtrain.train.checkpoint import Checkpointer
from podtrain.train.digest import checksums

MODEL = [
    "model.d_model=640",
    "model.n_layers=10",
    "model.n_heads=10",
    "model.n_kv_heads=10",
    "model.d_ff=1920",
    "model.max_seq_len=64",
]
TRAIN = ["train.seq_len=64", "train.batch_size=2", "model.compute_dtype=float32", "device_type=cpu"]


def run(job, steps: int, every: int, checkpointer: Checkpointer | None) -> float:
    """Wall seconds of `steps` steps from a new state (saving every `every` with `checkpointer`),
    until all is written."""
    state = job.init_state(0)  # the step donates its input, so each run starts its own
    jax.block_until_ready(state)
    start = time.perf_counter()
    for i in range(steps):
        state, _ = job.step(state, job.task.batches[i])
        if checkpointer and (i + 1) % every == 0:
            checkpointer.save(state)
    jax.block_until_ready(state)
    if checkpointer:
        checkpointer.wait()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    cfg = load_config(None, MODEL + TRAIN)
    job = build(cfg, build_mesh(cfg.mesh, jax.devices()[:1]))
    state, _ = job.step(job.init_state(0), job.task.batches[0])  # compile outside the timings
    saves = args.steps // args.every
    gib = sum(x.nbytes for x in jax.tree.leaves({k: v for k, v in state.items() if k != "step"})) / 2**30
    print(
        f"model: {job.setup.fns.n_params / 1e6:.1f}M params; checkpoint {gib:.2f} GiB (params + Adam moments); "
        f"{args.steps} steps, a save every {args.every}"
    )

    checksums({k: v for k, v in state.items() if k != "step"})  # compile the checksums outside the timings too

    folder = Path(tempfile.mkdtemp(prefix="podtrain-stall-"))
    try:
        times = {"none": [], "sync": [], "async": []}
        for repeat in range(args.repeats):  # alternated, so that drifts in the machine's speed hit all three
            for mode in times:
                checkpointer = (
                    Checkpointer(folder / f"{mode}{repeat}", keep=2, async_save=mode == "async")
                    if mode != "none"
                    else None
                )
                times[mode].append(run(job, args.steps, args.every, checkpointer))
                if checkpointer:
                    checkpointer.close()
        base = statistics.median(times["none"])
        step = base / args.steps
        print(
            f"step without saving: {step * 1e3:.0f} ms (runs of {args.steps} steps: "
            + ", ".join(f"{t:.2f}" for t in times["none"])
            + " s)"
        )
        stall = {mode: (statistics.median(times[mode]) - base) / saves for mode in ("sync", "async")}
        for mode in ("sync", "async"):
            print(
                f"{mode:>5} save: stall {stall[mode] * 1e3:6.0f} ms per save = {stall[mode] / step:5.2f} steps; "
                f"{stall[mode] / args.every * 1e3:5.0f} ms per step (runs: "
                + ", ".join(f"{t:.2f}" for t in times[mode])
                + " s)"
            )
        print(f"async / sync stall: {stall['async'] / stall['sync']:.2f}")
        start = time.perf_counter()
        checksums({k: v for k, v in state.items() if k != "step"})
        print(f"checksums of the state, part of every save and restore: {(time.perf_counter() - start) * 1e3:.0f} ms")

        abstract = {k: v for k, v in job.abstract_state.items() if k != "step"}
        checkpointer = Checkpointer(folder / "async0")
        start = time.perf_counter()
        restored = checkpointer.restore(abstract)
        jax.block_until_ready(restored)
        restore = time.perf_counter() - start
        start = time.perf_counter()
        checksums({k: v for k, v in restored.items() if k != "step"})
        verify = time.perf_counter() - start
        checkpointer.close()
        print(
            f"restore of step {int(restored['step'])}: {restore:.2f} s = {restore / step:.1f} steps, "
            f"of which the checksums {verify:.2f} s ({verify / restore:.0%})"
        )
    finally:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
