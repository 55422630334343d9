"""`podtrain profile`: a few train steps of the job under jax.profiler, and the ops that took the longest.

One step compiles first, outside the trace; the traced steps then run back to back on the
config's own data and mesh, from a fresh state (no run directory is trained or resumed). The
trace goes to RUN_DIR/profile, as `train.profile_steps` writes it.
"""

from __future__ import annotations

from pathlib import Path

import jax

from podtrain import runtime, storage
from podtrain.config.schema import Config
from podtrain.program.prepare import prepare
from podtrain.runtime.chips import device_memory
from podtrain.train.profile import newest_trace, ops_by_time


def profile(cfg: Config, steps: int = 3, top: int = 10) -> Path:
    """Trace `steps` steps and print the `top` ops by time; returns the trace's folder."""
    rt = runtime.start(cfg)
    ready = prepare(cfg, rt.platform, rt.mesh, device_memory(rt.devices[0]))
    job, step = ready.job, ready.step
    state, batches = job.init_state(cfg.seed), job.task.batches
    state, _ = step(state, batches[0])
    jax.block_until_ready(state)
    out = storage.join(cfg.run_dir, "profile")
    with storage.staged(out) as folder:
        if rt.is_main:  # one trace file name per host
            jax.profiler.start_trace(str(folder), create_perfetto_trace=True)
        for i in range(1, steps + 1):
            state, _ = step(state, batches[i % len(batches)])
        jax.block_until_ready(state)
        if not rt.is_main:
            return out
        jax.profiler.stop_trace()
        trace = newest_trace(folder)
    ops = ops_by_time(trace)
    total = sum(seconds for _, seconds, _ in ops) or 1.0
    print(f"[podtrain] trace of {steps} steps in {trace}")
    print(f"[podtrain] the {min(top, len(ops))} ops that took the longest, of {total * 1e3:.1f} ms in all ops:")
    print(f"{'ms':>10} {'share':>7} {'runs':>6}  op")
    for name, seconds, runs in ops[:top]:
        print(f"{seconds * 1e3:10.2f} {seconds / total:7.1%} {runs:6d}  {name}")
    print(
        f"[podtrain] open it with `tensorboard --logdir {out}` (the profile plugin, `pip install "
        "tensorboard-plugin-profile`), or perfetto_trace.json.gz at https://ui.perfetto.dev"
    )
    return trace
