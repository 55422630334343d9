"""The training loop: data in, steps, metrics, periodic eval and checkpoints, a sample at the end."""

from __future__ import annotations

import time
from contextlib import closing
from pathlib import Path

import jax
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from podtrain import runtime
from podtrain.config import Config, default_config, differences, resolve_auto, run_config, save_config
from podtrain.data.text import RUN_TOKENIZER, check_run_tokenizer
from podtrain.data.tokenizer import keep_tokenizer
from podtrain.errors import CheckpointError, ConfigError, Preempted, TrainingDiverged
from podtrain.train import fit, hf, optim
from podtrain.train.checkpoint import Checkpointer, CheckpointMismatch, run_checkpoints
from podtrain.train.job import Job, build
from podtrain.train.metrics import MetricsLog
from podtrain.train.preemption import StopRequests
from podtrain.train.state import weights


def _throughput(step_time: float | None, tokens_per_step: int, flops_per_step: float, peak_flops: float | None) -> dict:
    """tokens/s and MFU from the mean step time; None where unmeasured or the peak is unknown."""
    return {
        "tokens_per_sec": tokens_per_step / step_time if step_time else None,
        "step_time": step_time,
        "mfu": flops_per_step / step_time / peak_flops if step_time and peak_flops else None,
    }


def resume(job: Job, checkpointer: Checkpointer, cfg: Config, say) -> dict:
    """The state of the run's newest intact checkpoint (damaged newer ones set aside); from weights
    alone (a checkpoint `convert` wrote, or train.init_from) a fresh optimizer; else a new state."""
    latest = checkpointer.latest_step()
    if latest is not None and checkpointer.holds(latest, "opt"):
        try:
            return checkpointer.restore(
                {k: v for k, v in job.abstract_state.items() if k != "step"}, set_aside=True, say=say
            )
        except CheckpointMismatch as e:
            saved = Path(cfg.run_dir) / "config.yaml"
            changed = (
                [d for d in differences(saved, cfg) if d.startswith(("model.", "train."))] if saved.is_file() else []
            )
            why = f" The run's config.yaml differs from this config in: {'; '.join(changed)}." if changed else ""
            raise CheckpointError(
                f"{e}{why} Resume with the config the run was trained with, or use a new run_dir."
            ) from None
    abstract = job.setup.fns.abstract_params
    if latest is not None:
        say(f"[podtrain] starting from the weights of step {latest} in {cfg.checkpoint_dir}, with a fresh optimizer")
        return job.init_state(cfg.seed, checkpointer.restore({"params": abstract}, say=say)["params"])
    if cfg.train.init_from:
        say(f"[podtrain] starting from the weights of {cfg.train.init_from}, with a fresh optimizer")
        return job.init_state(cfg.seed, initial_weights(cfg.train.init_from, abstract, cfg))
    return job.init_state(cfg.seed)


def initial_weights(source: str, abstract_params, cfg: Config):
    """train.init_from: the weights of a podtrain run directory (its EMA where it kept one) or of
    a Hugging Face Llama checkpoint (a folder or a hub name), checked against this config's sizes."""
    if (Path(source) / "config.yaml").is_file():
        checkpointer = Checkpointer(run_checkpoints(source, run_config(source)))
        try:
            return checkpointer.restore_weights(abstract_params)
        except CheckpointMismatch as e:
            changed = [d for d in differences(Path(source) / "config.yaml", cfg) if d.startswith("model.")]
            raise CheckpointError(
                f"train.init_from={source}: {e} Its config differs in: {'; '.join(changed) or 'no model key'}; give this run the same model keys."
            ) from None
        finally:
            checkpointer.close()
    folder = hf.hf_folder(source)
    keys = hf.model_keys(hf.read_hf_config(folder), source)
    changed = (
        hf.shape_differences(keys, cfg.model)
        if cfg.model.name == "llama"
        else [f"model.name ({keys['name']} there, {cfg.model.name} here)"]
    )
    if changed:
        raise ConfigError(
            f"train.init_from={source} is a Llama of other sizes: {'; '.join(changed)}. Give this run its model keys (the config.yaml `podtrain convert --from-hf` writes has them)."
        )
    return hf.read_params(folder, abstract_params, source)


def divergence_hint(cfg: Config, latest: int | None) -> str:
    """The likely cause, from how far the learning rate and warmup are from the model's defaults,
    and what survives: the newest complete checkpoint, verified on resume or written from this
    run's finite state (skipped updates never reach one)."""
    t, usual = cfg.train, default_config(cfg.model.name).train
    if t.lr > 3 * usual.lr:
        cause = f"train.lr={t.lr:g} is {t.lr / usual.lr:,.0f}x this model's default ({usual.lr:g}): lower it"
    elif t.warmup_steps < usual.warmup_steps / 2:
        cause = f"train.warmup_steps={t.warmup_steps} is a short warmup (default {usual.warmup_steps}): raise it, or lower train.lr={t.lr:g}"
    else:
        cause = f"lower train.lr={t.lr:g} or raise train.warmup_steps={t.warmup_steps}"
    kept = (
        f"The checkpoint of step {latest} in {cfg.checkpoint_dir} is intact"
        if latest is not None
        else "No checkpoint had been written yet"
    )
    return f"Likely cause: {cause}. {kept}."


def _due(done: int, every: int, steps: int) -> bool:
    """Whether a periodic action (log, eval, checkpoint) runs after step `done`: every `every`
    steps (0: never) and always after the last."""
    return done == steps or (every > 0 and done % every == 0)


def _fmt(metrics: dict) -> str:
    return "  ".join(f"{k} {v:.4g}" for k, v in metrics.items())


def train(cfg: Config) -> dict:
    """Train to cfg.train.steps, resuming from the run's latest checkpoint. Returns the last metrics."""
    rt = runtime.start(cfg)
    cfg = resolve_auto(cfg, rt.platform)
    t = cfg.train
    run_dir = Path(cfg.run_dir)
    job = build(cfg, rt.mesh)
    fit.check(job, cfg, rt.devices)
    task = job.task
    if task.tokenizer is not None:
        check_run_tokenizer(run_dir, task.tokenizer)
    console = Console(quiet=not rt.is_main, markup=False, highlight=False, soft_wrap=True)
    checkpointer = Checkpointer(cfg.checkpoint_dir, cfg.checkpoint.keep, cfg.checkpoint.async_save)
    state = resume(job, checkpointer, cfg, console.print)
    start = int(jax.device_get(state["step"]))
    if rt.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
        if task.tokenizer is not None and task.tokenizer.file:
            keep_tokenizer(task.tokenizer, run_dir / RUN_TOKENIZER)
    console.print(
        f"[podtrain] model {cfg.model.name}: {job.setup.fns.n_params / 1e6:.2f}M params, {cfg.model.compute_dtype} compute; "
        f"{task.summary}; " + (f"resuming from step {start}" if start else "starting from scratch")
    )

    note = optim.warmup_note(t)
    if note:
        console.print(f"[podtrain] note: {note}")
    tokens_per_step, flops_per_step = job.tokens_per_step, job.flops_per_step
    if start >= t.steps:
        checkpointer.close()
        console.print(
            f"[podtrain] {run_dir} already trained to step {start}; raise train.steps to train further, or use a new run_dir."
        )
        return {"step": start}
    log = MetricsLog(run_dir, start, rt.is_main)
    last: dict = {"step": start}
    columns = [
        TextColumn("step {task.completed}/{task.total}"),
        BarColumn(),
        TextColumn("{task.fields[status]}"),
        TimeRemainingColumn(),
    ]
    try:  # finish pending checkpoint writes and flush metrics, also on errors
        batches = task.batches.stream(start, t.steps, cfg.data.workers, cfg.data.prefetch)
        with (
            Progress(*columns, console=console, disable=not rt.is_main) as progress,
            StopRequests() as stop,
            closing(batches),
        ):
            bar = progress.add_task("train", total=t.steps, completed=start, status="compiling")
            window_start, clock = start, time.perf_counter()
            bad_run, previous = (
                0,
                None,
            )  # consecutive skipped updates; the last step's flag, read one step late to keep dispatch ahead
            for step, batch in zip(range(start, t.steps), batches):
                state, metrics = job.step(state, batch)
                done = step + 1
                if previous is not None:
                    bad_run = bad_run + 1 if bool(previous) else 0
                    if bad_run >= t.max_bad_steps:
                        checkpointer.wait()
                        raise TrainingDiverged(
                            f"The loss or gradient norm was not finite at steps {done - bad_run} to {done - 1} (train.max_bad_steps={t.max_bad_steps} in a row); "
                            f"those updates were skipped. {divergence_hint(cfg, checkpointer.latest_step())}"
                        )
                previous = metrics["skipped"]
                if done == start + 1:  # leave compilation out of the throughput
                    jax.block_until_ready(state)
                    window_start, clock = done, time.perf_counter()
                if _due(done, t.log_every, t.steps):
                    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
                    step_time = (time.perf_counter() - clock) / (done - window_start) if done > window_start else None
                    last = {
                        "step": done,
                        "epoch": task.batches.epoch(step),
                        **metrics,
                        **_throughput(step_time, tokens_per_step, flops_per_step, rt.peak_flops),
                    }
                    tps, mfu = last["tokens_per_sec"], last["mfu"]
                    log.write(last)
                    status = (
                        f"loss {metrics['loss']:.4f}"
                        + (f"  {tps:,.0f} tok/s" if tps else "")
                        + (f"  mfu {mfu:.1%}" if mfu else "")
                    )
                    progress.update(bar, status=status)
                    progress.console.print(
                        f"step {done:>6}  {_fmt(metrics)}"
                        + (f"  {tps:,.0f} tok/s" if tps else "")
                        + f"  epoch {last['epoch']}"
                    )
                    window_start, clock = done, time.perf_counter()
                evaluated, saved = _due(done, t.eval_every, t.steps), _due(done, cfg.checkpoint.every, t.steps)
                if evaluated:
                    evals = job.evaluate(weights(state))
                    last.update(evals)
                    log.write({"step": done, **evals}, prefix="eval")
                    progress.console.print(f"step {done:>6}  {_fmt(evals)}")
                if saved:
                    checkpointer.save(state)
                if evaluated or saved:
                    window_start, clock = done, time.perf_counter()  # keep eval and saving out of throughput
                progress.update(bar, completed=done)
                if stop.reached(done) and done < t.steps:
                    if not saved:
                        checkpointer.save(state)  # written in full by close() below before the exit
                    raise Preempted(
                        f"stopped after step {done} and saved its checkpoint in {cfg.checkpoint_dir}; run the same command again to continue."
                    )
    finally:
        checkpointer.close()
        log.close()
    console.print(f"[podtrain] done: step {t.steps}, {_fmt(evals)}, checkpoint in {cfg.checkpoint_dir}")
    text = task.finish(job.setup.fns, weights(state))
    if text is not None:
        console.print("[podtrain] sample:\n" + text)
    return last
