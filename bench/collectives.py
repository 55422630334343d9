"""What each mesh costs: collective bytes per step and memory per device of the compiled train
step, for one model on 8 fake CPU devices, and step time per token against one device.

    python bench/collectives.py                          # the default (tiny) model
    python bench/collectives.py configs/llama_1b.yaml train.batch_size=16 --no-time
    python bench/collectives.py train.seq_len=4096 train.batch_size=1 --meshes 1x1x1x1x1x1,1x1x1x8x1x1 --no-time

Compiled ahead of time from abstract shapes, so a 1B-parameter model costs no memory here.
Bytes are of the whole arrays each collective moves, times its executions per step (a layer
scan's body counts once per layer); memory is XLA's `memory_analysis()` per device.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import argparse  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
from podtrain.planning.hlo import KINDS, collectives, summary  # noqa: E402
from podtrain.program.checks import resolve_auto  # noqa: E402
from podtrain.program.job import build  # noqa: E402
from podtrain.program.load import load_config  # noqa: E402
from podtrain.program.prepare import prepare  # noqa: E402
from podtrain.runtime.mesh import build_mesh  # noqa: E402
from podtrain.sharding import AXES  # noqa: E402

# data x stage x fsdp x context x expert x tensor
MESHES = "1x1x1x1x1x1,8x1x1x1x1x1,1x1x8x1x1x1,1x1x1x1x1x8,2x1x2x1x1x2"
MiB = 2**20


def seconds_per_step(cfg, mesh, steps: int) -> float:
    job = build(cfg, mesh)
    state = job.init_state(cfg.seed)
    state, _ = job.step(state, job.task.batches[0])  # compile
    jax.block_until_ready(state)
    start = time.perf_counter()
    for i in range(1, steps + 1):
        state, _ = job.step(state, job.task.batches[i])
    jax.block_until_ready(state)
    return (time.perf_counter() - start) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", nargs="?")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--steps", type=int, default=10, help="timed steps per mesh")
    p.add_argument("--no-time", action="store_true", help="only compile: collectives and memory")
    p.add_argument("--meshes", default=MESHES, help=f"{' x '.join(AXES)} shapes, comma-separated")
    args = p.parse_args()
    if args.config and "=" in args.config:
        args.overrides, args.config = [args.config, *args.overrides], None
    print(f"{args.config or 'default model'} {' '.join(args.overrides)}")
    print(
        f"{'mesh':>9} "
        + " ".join(f"{k + ' MiB':>20}" for k in KINDS)
        + f" {'args MiB':>10} {'temp MiB':>10} {'ms/step':>9} {'x 1 device':>10}"
    )
    reference = None
    for shape in (tuple(map(int, m.split("x"))) for m in args.meshes.split(",")):
        if len(shape) != len(AXES):
            p.error(f"--meshes: each shape has {len(AXES)} sizes, {' x '.join(AXES)}; got {'x'.join(map(str, shape))}")
        overrides = ["device_type=cpu", *args.overrides, *(f"mesh.{a}={s}" for a, s in zip(AXES, shape))]
        cfg = resolve_auto(load_config(args.config, overrides), "cpu")
        mesh = build_mesh(cfg.mesh, jax.devices()[: math.prod(shape)])
        compiled = prepare(cfg, "cpu", mesh, float("inf"), data=False).compiled
        totals, memory = summary(collectives(compiled.as_text())), compiled.memory_analysis()
        timing = ""
        if not args.no_time:
            step = seconds_per_step(cfg, mesh, args.steps)
            reference = reference or step
            timing = f" {step * 1e3:9.1f} {step / reference:10.2f}"
        print(
            f"{'x'.join(map(str, shape)):>9} "
            + " ".join(f"{totals[k] / MiB:20.2f}" for k in KINDS)
            + f" {memory.argument_size_in_bytes / MiB:10.2f} {memory.temp_size_in_bytes / MiB:10.2f}"
            + timing
        )


if __name__ == "__main__":
    main()
