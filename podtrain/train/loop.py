"""The training loop: data in, steps, metrics, periodic eval and checkpoints, a sample at the end."""

from __future__ import annotations

import math
import time
from pathlib import Path

import jax
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from podtrain import runtime
from podtrain.config import Config, resolve_auto, save_config
from podtrain.errors import ConfigError, TrainingDiverged
from podtrain.models import is_reasoner
from podtrain.runtime.mesh import data_parallel_size
from podtrain.train import optim
from podtrain.train.checkpoint import Checkpointer
from podtrain.train.lm import LanguageTask
from podtrain.train.metrics import MetricsLog
from podtrain.train.reasoning import PuzzleTask
from podtrain.train.state import train_setup, weights


def _check_batch(cfg: Config, dp: int) -> None:
    micro = cfg.train.batch_size // cfg.train.grad_accum
    if micro % dp:
        raise ConfigError(
            f"The microbatch of {micro} sequences (train.batch_size={cfg.train.batch_size} / train.grad_accum={cfg.train.grad_accum}) "
            f"does not split over the {dp} data-parallel shards (mesh data x fsdp). Make train.batch_size / train.grad_accum a multiple of {dp}."
        )


def _throughput(step_time: float | None, tokens_per_step: int, flops_per_step: float, peak_flops: float | None) -> dict:
    """tokens/s and MFU from the mean step time; None where unmeasured or the peak is unknown."""
    return {
        "tokens_per_sec": tokens_per_step / step_time if step_time else None,
        "step_time": step_time,
        "mfu": flops_per_step / step_time / peak_flops if step_time and peak_flops else None,
    }


def make_task(cfg: Config, setup, mesh) -> LanguageTask | PuzzleTask:
    """The data, step and evaluation of the model's kind: text for language models, puzzles for reasoners."""
    return (PuzzleTask if is_reasoner(cfg.model.name) else LanguageTask)(cfg, setup, mesh)


def compile_step(cfg: Config, mesh):
    """The train step compiled ahead of time from abstract shapes (no weights allocated), to read
    its memory (`memory_analysis()`) and collectives (`runtime.collectives`) before running it."""
    task = make_task(cfg, train_setup(cfg, mesh), mesh)
    return task.step.lower(task.abstract_state, task.batches.abstract).compile()


def _fmt(metrics: dict) -> str:
    return "  ".join(f"{k} {v:.4g}" for k, v in metrics.items())


def train(cfg: Config) -> dict:
    """Train to cfg.train.steps, resuming from the run's latest checkpoint. Returns the last metrics."""
    rt = runtime.start(cfg)
    cfg = resolve_auto(cfg, rt.platform)
    t = cfg.train
    _check_batch(cfg, data_parallel_size(rt.mesh))
    run_dir = Path(cfg.run_dir)
    setup = train_setup(cfg, rt.mesh)
    task = make_task(cfg, setup, rt.mesh)
    checkpointer = Checkpointer(cfg.checkpoint_dir, cfg.checkpoint.keep, cfg.checkpoint.async_save)
    resumed = checkpointer.latest_step()
    state = task.init_state() if resumed is None else checkpointer.restore({k: v for k, v in task.abstract_state.items() if k != "step"})
    if rt.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
    console = Console(quiet=not rt.is_main, markup=False, highlight=False, soft_wrap=True)
    console.print(
        f"[podtrain] model {cfg.model.name}: {setup.fns.n_params / 1e6:.2f}M params, {cfg.model.compute_dtype} compute; "
        f"{task.summary}; "
        + (f"resuming from step {resumed}" if resumed is not None else "starting from scratch")
    )

    note = optim.warmup_note(t)
    if note:
        console.print(f"[podtrain] note: {note}")
    tokens_per_step, flops_per_step = task.tokens_per_step, task.flops_per_step
    start = int(jax.device_get(state["step"]))
    if start >= t.steps:
        checkpointer.close()
        console.print(f"[podtrain] {run_dir} already trained to step {start}; raise train.steps to train further, or use a new run_dir.")
        return {"step": start}
    log = MetricsLog(run_dir, rt.is_main)
    last: dict = {"step": start}
    columns = [TextColumn("step {task.completed}/{task.total}"), BarColumn(), TextColumn("{task.fields[status]}"), TimeRemainingColumn()]
    try:  # finish pending checkpoint writes and flush metrics, also on errors
        with Progress(*columns, console=console, disable=not rt.is_main) as progress:
            bar = progress.add_task("train", total=t.steps, completed=start, status="compiling")
            window_start, clock = start, time.perf_counter()
            for step in range(start, t.steps):
                state, metrics = task.step(state, task.batches[step])
                done = step + 1
                if done == start + 1:  # leave compilation out of the throughput
                    jax.block_until_ready(state)
                    window_start, clock = done, time.perf_counter()
                if done % t.log_every == 0 or done == t.steps:
                    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
                    if not math.isfinite(metrics["loss"]):
                        raise TrainingDiverged(
                            f"The loss became {metrics['loss']} at step {done}. Lower train.lr or raise train.warmup_steps; "
                            f"checkpoints up to step {checkpointer.latest_step()} in {cfg.checkpoint_dir} are intact."
                        )
                    step_time = (time.perf_counter() - clock) / (done - window_start) if done > window_start else None
                    last = {"step": done, **metrics, **_throughput(step_time, tokens_per_step, flops_per_step, rt.peak_flops)}
                    tps, mfu = last["tokens_per_sec"], last["mfu"]
                    log.write(last)
                    status = f"loss {metrics['loss']:.4f}" + (f"  {tps:,.0f} tok/s" if tps else "") + (f"  mfu {mfu:.1%}" if mfu else "")
                    progress.update(bar, status=status)
                    progress.console.print(f"step {done:>6}  {_fmt(metrics)}" + (f"  {tps:,.0f} tok/s" if tps else ""))
                    window_start, clock = done, time.perf_counter()
                if done % t.eval_every == 0 or done == t.steps:
                    evals = task.evaluate(weights(state))
                    last.update(evals)
                    log.write({"step": done, **evals}, prefix="eval")
                    progress.console.print(f"step {done:>6}  {_fmt(evals)}")
                if done % cfg.checkpoint.every == 0 or done == t.steps:
                    checkpointer.save(state)
                if done % t.eval_every == 0 or done % cfg.checkpoint.every == 0:
                    window_start, clock = done, time.perf_counter()  # keep eval and saving out of throughput
                progress.update(bar, completed=done)
    finally:
        checkpointer.close()
        log.close()
    console.print(f"[podtrain] done: step {t.steps}, {_fmt(evals)}, checkpoint in {cfg.checkpoint_dir}")
    text = task.finish(state)
    if text is not None:
        console.print("[podtrain] sample:\n" + text)
    return last
