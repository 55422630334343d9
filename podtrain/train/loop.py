"""`podtrain train`: set the run up on this machine, resume it, and drive the trainer with its hooks."""

from __future__ import annotations

import dataclasses
from contextlib import closing, nullcontext

import jax
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from podtrain import runtime
from podtrain.config.schema import Config
from podtrain.errors import CheckpointError
from podtrain.planning import fit, precision
from podtrain.program import optim
from podtrain.program.job import Job
from podtrain.program.prepare import Prepared, prepare
from podtrain.program.saved import differences, run_config
from podtrain.program.state import weights
from podtrain.runtime import distributed
from podtrain.runtime.chips import chip_of, device_memory
from podtrain.train import replica
from podtrain.train.checkpoint import Checkpointer, CheckpointMismatch
from podtrain.train.goodput import Goodput, summary
from podtrain.train.hooks import TrainHooks, fmt_metrics
from podtrain.train.metrics import MetricsLog
from podtrain.train.preemption import StopRequests
from podtrain.train.run import Run, starting_weights
from podtrain.train.trainer import Trainer


def resume(job: Job, checkpointer: Checkpointer, cfg: Config, say) -> dict:
    """The state of the run's newest intact checkpoint (damaged newer ones set aside); from weights
    alone (a checkpoint `convert` wrote, or train.init_from) a fresh optimizer; else a new state.
    LoRA's checkpoints keep the adapters: the base is read again from train.init_from."""
    state = _resumed(job, checkpointer, cfg, say)
    if job.lora and "base" not in state:
        trained_on = run_config(cfg.run_dir).train.init_from
        if trained_on != cfg.train.init_from:
            raise CheckpointError(
                f"The adapters in {cfg.checkpoint_dir} were trained on train.init_from={trained_on}, not "
                f"{cfg.train.init_from}; resume with their base, or use a new run_dir."
            )
        state["base"] = starting_weights(cfg.train.init_from, job.setup.abstract_start, cfg)
    return state


def _resumed(job: Job, checkpointer: Checkpointer, cfg: Config, say) -> dict:
    latest = checkpointer.latest_step()
    if state := from_replica(job, checkpointer, cfg, latest, say):
        return state
    if latest is not None and checkpointer.holds(latest, "opt"):
        try:
            return checkpointer.restore(job.saved_state, set_aside=True, say=say)
        except CheckpointMismatch as e:
            changed = differences(cfg.run_dir, cfg, ("model.", "train."))
            why = f" The run's config.yaml differs from this config in: {changed}." if changed else ""
            raise CheckpointError(
                f"{e}{why} Resume with the config the run was trained with, or use a new run_dir."
            ) from None
    abstract = job.setup.abstract_start
    if latest is not None:
        say(f"[podtrain] starting from the weights of step {latest} in {cfg.checkpoint_dir}, with a fresh optimizer")
        return job.init_state(cfg.seed, checkpointer.restore({"params": abstract}, say=say)["params"])
    if cfg.train.init_from:
        say(f"[podtrain] starting from the weights of {cfg.train.init_from}, with a fresh optimizer")
        return job.init_state(cfg.seed, starting_weights(cfg.train.init_from, abstract, cfg))
    return job.init_state(cfg.seed)


def from_replica(job: Job, checkpointer: Checkpointer, cfg: Config, latest: int | None, say) -> dict | None:
    """The state the processes left after a loss wrote out (podtrain.train.replica), where it is newer
    than the newest checkpoint and whole: saved at once as a checkpoint of its step."""
    abstract = job.saved_state
    found = replica.newest(cfg.checkpoint_dir, abstract, latest)
    if found is None:
        return None
    step, host = found
    say(f"[podtrain] the processes left after a loss kept step {step} whole, newer than the newest checkpoint")
    where = job.abstract_state["step"].sharding
    state = {**replica.place(host, abstract), "step": jax.device_put(np.int32(step), where)}
    checkpointer.save(state)
    checkpointer.wait()
    if jax.process_index() == 0:
        replica.discard(cfg.checkpoint_dir)
    return state


def train(cfg: Config) -> dict:
    """Train to cfg.train.steps, resuming from the run's latest checkpoint. Returns the last metrics."""
    goodput = Goodput()
    rt = runtime.start(cfg)
    with goodput.charge("compile"):
        ready = prepare(cfg, rt.platform, rt.mesh, device_memory(rt.devices[0]))
    fit.check(ready, rt.devices)
    run = Run.of(ready.cfg)
    if ready.job.task.tokenizer is not None:
        run.check_tokenizer(ready.job.task.tokenizer)
    tasks = None
    if cfg.eval.tasks:  # named and read before any weights; lm-eval is the optional extra `eval`
        from podtrain.program.harness import Tasks

        tasks = Tasks(ready.cfg, ready.job.task.tokenizer)
    with run.lock() if rt.is_main else nullcontext(), distributed.peer_loss_in_one_line():  # one job per run dir
        return _train(cfg, rt, run, ready, goodput, tasks)


def _adapted(cfg: Config, job: Job) -> str:
    """What LoRA trains of the model, for the first line of a run."""
    if not job.lora:
        return ""
    lora = cfg.train.lora
    return f" ({job.setup.n_trained / 1e6:.3f}M trained: LoRA rank {lora.rank} on {', '.join(lora.targets)})"


def _announce(say, asked: Config, ready: Prepared, chip, start: int) -> None:
    """The run's first lines: the model and its data, the step's memory, what the devices changed."""
    cfg, job = ready.cfg, ready.job
    t, task = cfg.train, job.task
    begin = f"resuming from step {start}" if start else "from its initial weights" if t.init_from else "from scratch"
    say(
        f"[podtrain] model {cfg.model.name}: {job.setup.fns.n_params / 1e6:.2f}M params{_adapted(cfg, job)}, "
        f"{cfg.model.compute_dtype} compute; {task.summary}; {begin}"
    )
    if ready.unroll_by_memory:
        say(f"[podtrain] model.scan_unroll=auto: {cfg.model.scan_unroll} (by the compiled step's memory)")
    if said := precision.no_gain(chip, cfg.model.matmul_precision):
        say(f"[podtrain] model.matmul_precision={cfg.model.matmul_precision}: {said}")
    say(f"[podtrain] step memory: {ready.memory.summary()}")
    if t.grad_accum != asked.train.grad_accum:
        say(
            f"[podtrain] train.grad_accum={t.grad_accum} on these devices (the config says {asked.train.grad_accum}): "
            f"the batch of {t.batch_size} in microbatches that split over them"
            + (f", at most {t.device_batch} per device" if t.device_batch else "")
        )
    for line in job.replicated[:8]:
        say(f"[podtrain] replicated, as the mesh does not divide it: {line}")
    if note := optim.warmup_note(t):
        say(f"[podtrain] note: {note}")


def _train(asked: Config, rt, run: Run, ready: Prepared, goodput: Goodput, tasks) -> dict:
    cfg, job, memory = ready.cfg, ready.job, ready.memory
    t, task = cfg.train, job.task
    console = Console(quiet=not rt.is_main, markup=False, highlight=False, soft_wrap=True)
    checkpointer = run.checkpointer()
    with goodput.charge("checkpoint" if checkpointer.latest_step() is not None else "startup"):
        state = resume(job, checkpointer, cfg, console.print)
    start = int(jax.device_get(state["step"]))
    if rt.is_main:
        run.keep(cfg, task.tokenizer)
    task.start(job.setup.fns, weights(state), run.dir, start)  # before its summary: DPO's reference goes in it
    _announce(console.print, asked, ready, chip_of(rt.devices[0]), start)
    if start >= t.steps:
        checkpointer.close()
        console.print(
            f"[podtrain] {run.dir} already trained to step {start}; raise train.steps to train further, "
            "or use a new run_dir."
        )
        return {"step": start}
    log = MetricsLog(cfg, start, rt.is_main)
    log.write({"step": start, **{f"{k}_bytes": v for k, v in dataclasses.asdict(memory).items()}}, prefix="memory")
    columns = [TextColumn("step {task.completed}/{task.total}"), BarColumn(), TextColumn("{task.fields[status]}")]
    try:  # finish pending checkpoint writes and flush metrics, also on errors
        batches = task.batches.stream(start, t.steps, cfg.data.workers, cfg.data.prefetch)
        with (
            Progress(*columns, TimeRemainingColumn(), console=console, disable=not rt.is_main) as progress,
            StopRequests() as stop,
            closing(batches),
        ):
            bar = progress.add_task("train", total=t.steps, completed=start, status="compiling")
            hooks = TrainHooks(cfg, job, checkpointer, log, stop, (progress, bar, rt.peak_flops), start, goodput, tasks)
            trainer = Trainer(ready.step)
            hooks.attach(trainer)
            with distributed.peer_loss_in_one_line():  # before any cleanup: its collectives would not match
                state = trainer.run(state, goodput.steps(start, log.logged_past, batches), start, t.steps)
        with goodput.charge("checkpoint"):
            checkpointer.wait()
        accounted = goodput.report()
        log.write({"step": t.steps, **accounted}, prefix="goodput")
    finally:
        checkpointer.close()
        log.close()
    console.print(f"[podtrain] done: step {t.steps}, {fmt_metrics(hooks.evals)}, checkpoint in {cfg.checkpoint_dir}")
    console.print(f"[podtrain] {summary(accounted)}")
    text = task.finish(job.setup.fns, weights(state))
    if text is not None:
        console.print("[podtrain] sample:\n" + text)
    return hooks.last
