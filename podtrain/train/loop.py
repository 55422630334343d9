"""The training loop: data in, steps, metrics, periodic eval and checkpoints, a sample at the end."""

from __future__ import annotations

import math
import time
from pathlib import Path

import jax
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from podtrain import runtime
from podtrain.config import Config, resolve_auto, save_config
from podtrain.data.loader import BatchReader, eval_windows, train_windows
from podtrain.data.text import load_tokens
from podtrain.errors import ConfigError, DataError, TrainingDiverged
from podtrain.models import flops_per_token
from podtrain.runtime.mesh import data_parallel_size
from podtrain.train.checkpoint import Checkpointer
from podtrain.train.metrics import MetricsLog
from podtrain.train.sample import sample
from podtrain.train.state import init_state, train_setup, weights
from podtrain.train.step import batch_sharding, make_eval_step, make_train_step

BYTE_VOCAB = 256


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


def train(cfg: Config) -> dict:
    """Train to cfg.train.steps, resuming from the run's latest checkpoint. Returns the last metrics."""
    rt = runtime.start(cfg)
    cfg = resolve_auto(cfg, rt.platform)
    t = cfg.train
    _check_batch(cfg, data_parallel_size(rt.mesh))
    if cfg.model.vocab_size < BYTE_VOCAB:
        raise DataError(f"Byte-level text has token ids up to {BYTE_VOCAB - 1}, out of range for model.vocab_size={cfg.model.vocab_size}; set model.vocab_size>={BYTE_VOCAB}.")
    run_dir = Path(cfg.run_dir)
    train_tokens, val_tokens = load_tokens(cfg.data)

    setup = train_setup(cfg, rt.mesh)
    checkpointer = Checkpointer(cfg.checkpoint_dir, cfg.checkpoint.keep, cfg.checkpoint.async_save)
    resumed = checkpointer.latest_step()
    state = init_state(setup, cfg.seed) if resumed is None else checkpointer.restore({k: v for k, v in setup.abstract_state.items() if k != "step"})
    if rt.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
    console = Console(quiet=not rt.is_main, markup=False, highlight=False, soft_wrap=True)
    console.print(
        f"[podtrain] model {cfg.model.name}: {setup.fns.n_params / 1e6:.2f}M params, {cfg.model.compute_dtype} compute; "
        f"{len(train_tokens):,} train / {len(val_tokens):,} val tokens; "
        + (f"resuming from step {resumed}" if resumed is not None else "starting from scratch")
    )

    train_step, eval_step = make_train_step(setup, t, rt.mesh), make_eval_step(setup, rt.mesh)
    micro = t.batch_size // t.grad_accum
    batches = BatchReader(train_windows(train_tokens, t.seq_len, t.batch_size, cfg.seed), batch_sharding(rt.mesh, leading=1), (t.grad_accum, micro, t.seq_len + 1), axis=1)
    val = BatchReader(eval_windows(val_tokens, t.seq_len, t.batch_size, t.eval_batches), batch_sharding(rt.mesh), (t.batch_size, t.seq_len + 1), axis=0)

    def evaluate(params) -> float:
        # Each loss is a mean over the global batch, reduced across all processes inside the step.
        return float(np.mean([jax.device_get(eval_step(params, val[i])) for i in range(len(val))]))

    tokens_per_step = t.batch_size * t.seq_len
    flops_per_step = flops_per_token(cfg.model, setup.fns.n_params, t.seq_len) * tokens_per_step
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
            task = progress.add_task("train", total=t.steps, completed=start, status="compiling")
            window_start, clock = start, time.perf_counter()
            for step in range(start, t.steps):
                state, metrics = train_step(state, batches[step])
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
                    progress.update(task, status=status)
                    progress.console.print(f"step {done:>6}  loss {metrics['loss']:.4f}  lr {metrics['lr']:.2e}  grad_norm {metrics['grad_norm']:.3f}" + (f"  {tps:,.0f} tok/s" if tps else ""))
                    window_start, clock = done, time.perf_counter()
                if done % t.eval_every == 0 or done == t.steps:
                    last["val_loss"] = evaluate(weights(state))
                    log.write({"step": done, "val_loss": last["val_loss"]}, prefix="eval")
                    progress.console.print(f"step {done:>6}  val_loss {last['val_loss']:.4f}")
                if done % cfg.checkpoint.every == 0 or done == t.steps:
                    checkpointer.save(state)
                if done % t.eval_every == 0 or done % cfg.checkpoint.every == 0:
                    window_start, clock = done, time.perf_counter()  # keep eval and saving out of throughput
                progress.update(task, completed=done)
    finally:
        checkpointer.close()
        log.close()
    console.print(f"[podtrain] done: step {t.steps}, val_loss {last['val_loss']:.4f}, checkpoint in {cfg.checkpoint_dir}")
    if t.sample_tokens:
        text = sample(setup.fns, weights(state), "The ", t.sample_tokens, 0.8, t.seq_len, cfg.seed)  # on every process: params span them all
        console.print("[podtrain] sample:\n" + "The " + text)
    return last
