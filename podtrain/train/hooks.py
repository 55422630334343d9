"""The hooks of a training run: metrics, evaluation, checkpoints, divergence and stop requests.

Each is a method taking the trainer's StepEnd; `TrainHooks.attach` registers them with their
periods. They share the throughput window (compilation, evaluation and saves left out of it)
and the last metrics, which `train` returns.
"""

from __future__ import annotations

import time

import jax

from podtrain import storage
from podtrain.config.schema import Config
from podtrain.errors import Preempted, TrainingDiverged
from podtrain.program.job import Job
from podtrain.program.load import default_config
from podtrain.program.state import weights
from podtrain.runtime import peers
from podtrain.train import replica
from podtrain.train.checkpoint import Checkpointer
from podtrain.train.goodput import Goodput
from podtrain.train.metrics import MetricsLog
from podtrain.train.preemption import StopRequests
from podtrain.train.profile import Trace
from podtrain.train.trainer import StepEnd, Trainer


def divergence_hint(cfg: Config, latest: int | None) -> str:
    """The likely cause, from how far the learning rate and warmup are from the model's defaults,
    and what survives: the newest complete checkpoint, verified on resume or written from this
    run's finite state (skipped updates never reach one)."""
    t, usual = cfg.train, default_config(cfg.model.name).train
    if t.lr > 3 * usual.lr:
        cause = f"train.lr={t.lr:g} is {t.lr / usual.lr:,.0f}x this model's default ({usual.lr:g}): lower it"
    elif t.warmup_steps < usual.warmup_steps / 2:
        cause = (
            f"train.warmup_steps={t.warmup_steps} is a short warmup (default {usual.warmup_steps}): "
            f"raise it, or lower train.lr={t.lr:g}"
        )
    else:
        cause = f"lower train.lr={t.lr:g} or raise train.warmup_steps={t.warmup_steps}"
    kept = (
        f"The checkpoint of step {latest} in {cfg.checkpoint_dir} is intact"
        if latest is not None
        else "No checkpoint had been written yet"
    )
    return f"Likely cause: {cause}. {kept}."


def fmt_metrics(metrics: dict) -> str:
    """The metrics for the console; those with a '/' in their name (one per layer) are left to the logs."""
    return "  ".join(f"{k} {v:.4g}" for k, v in metrics.items() if "/" not in k)


class Throughput:
    """The mean step time since the window opened; compilation, evaluation and saves stay out."""

    def __init__(self, start: int):
        self.first, self.clock = start, time.perf_counter()

    def restart(self, done: int) -> None:
        self.first, self.clock = done, time.perf_counter()

    def step_time(self, done: int) -> float | None:
        return (time.perf_counter() - self.clock) / (done - self.first) if done > self.first else None


class TrainHooks:
    def __init__(
        self,
        cfg: Config,
        job: Job,
        checkpointer: Checkpointer,
        log: MetricsLog,
        stop: StopRequests,
        ui,
        start: int,
        goodput: Goodput,
        tasks=None,  # eval.tasks: a program.harness.Tasks (lm-eval, an optional extra)
    ):
        self.cfg, self.job, self.checkpointer, self.log, self.stop = cfg, job, checkpointer, log, stop
        self.goodput, self.tasks = goodput, tasks
        self.progress, self.bar, self.peak_flops = ui  # the rich Progress, its bar, the mesh's peak FLOP/s
        self.start = start
        self.window = Throughput(start)
        self.last: dict = {"step": start}
        self.bad_run, self.previous = 0, None  # skipped updates in a row; the last step's flag, read a step late
        self.saved = start
        self.evals: dict = {}  # the last evaluation's metrics

    def attach(self, trainer: Trainer) -> None:
        t = self.cfg.train
        trainer.add_hook(self.after_compile)
        trainer.add_hook(self.divergence)
        trainer.add_hook(self.write_metrics, t.log_every)
        trainer.add_hook(self.evaluate, t.eval_every)
        if self.tasks is not None:
            trainer.add_hook(self.score_tasks, self.cfg.eval.every)
        trainer.add_hook(self.save, self.cfg.checkpoint.every)
        if self.cfg.checkpoint.replica_every and jax.process_count() > 1:
            trainer.add_hook(self.host_copy(), self.cfg.checkpoint.replica_every)
        trainer.add_hook(self.advance_bar)
        trainer.add_hook(self.stop_if_asked)
        if t.profile_steps and jax.process_index() == 0:  # one trace file name per host
            trace = Trace(storage.join(self.cfg.run_dir, "profile"), *t.profile_steps, self.start, self.goodput)
            trainer.add_hook(trace.after_step)
        trainer.add_hook(self.goodput.after_step)  # last: the step's time includes its other hooks

    def host_copy(self):
        """The hook that keeps the state in host memory, for the survivors of a loss to write out."""
        copy = replica.HostCopy(self.cfg.checkpoint_dir)
        peers.on_loss(lambda survivors: copy.write(jax.process_index(), survivors))

        def keep(end: StepEnd) -> None:
            with self.goodput.charge("checkpoint"):
                copy.keep(end.state)

        return keep

    def after_compile(self, end: StepEnd) -> None:
        """The first step compiles: leave it out of the throughput."""
        if end.done == self.start + 1:
            jax.block_until_ready(end.state)
            self.window.restart(end.done)

    def divergence(self, end: StepEnd) -> None:
        """Stop after train.max_bad_steps skipped (non-finite) steps in a row. The flag of the step
        before is read, so that reading it never waits for the step just dispatched."""
        if self.previous is not None:
            self.bad_run = self.bad_run + 1 if bool(self.previous) else 0
            if self.bad_run >= self.cfg.train.max_bad_steps:
                self.checkpointer.wait()
                first, t = end.done - self.bad_run, self.cfg.train
                raise TrainingDiverged(
                    f"The loss or gradient norm was not finite at steps {first} to {end.done - 1} "
                    f"(train.max_bad_steps={t.max_bad_steps} in a row); those updates were skipped. "
                    f"{divergence_hint(self.cfg, self.checkpointer.latest_step())}"
                )
        self.previous = end.metrics["skipped"]

    def write_metrics(self, end: StepEnd) -> None:
        metrics = {k: float(v) for k, v in jax.device_get(end.metrics).items()}
        step_time, job = self.window.step_time(end.done), self.job
        tokens_per_sec = job.tokens_per_step / step_time if step_time else None
        mfu = job.flops_per_step / step_time / self.peak_flops if step_time and self.peak_flops else None
        epoch = job.task.batches.epoch(end.done - 1)
        rates = {"tokens_per_sec": tokens_per_sec, "step_time": step_time, "mfu": mfu}
        self.last = {"step": end.done, "epoch": epoch, **metrics, **rates}
        self.log.write(self.last)
        rate = f"  {tokens_per_sec:,.0f} tok/s" if tokens_per_sec else ""
        status = f"loss {metrics['loss']:.4f}{rate}" + (f"  mfu {mfu:.1%}" if mfu else "")
        self.progress.update(self.bar, status=status)
        self.progress.console.print(f"step {end.done:>6}  {fmt_metrics(metrics)}{rate}  epoch {epoch}")
        self.window.restart(end.done)

    def evaluate(self, end: StepEnd) -> None:
        jax.block_until_ready(end.state)  # the step's own time is not the evaluation's
        with self.goodput.charge("eval"):
            evals = self.job.evaluate(weights(end.state))
        self.last.update(evals)
        self.evals = evals
        self.log.write({"step": end.done, **evals}, prefix="eval")
        self.progress.console.print(f"step {end.done:>6}  {fmt_metrics(evals)}")
        self.window.restart(end.done)

    def score_tasks(self, end: StepEnd) -> None:
        """eval.tasks on this step's weights, on the training mesh, logged as eval/TASK/METRIC."""
        jax.block_until_ready(end.state)
        with self.goodput.charge("eval"):
            scores = self.tasks.scores(self.job.setup.fns, weights(end.state))
        self.last.update(scores)
        self.log.write({"step": end.done, **scores}, prefix="eval")
        self.progress.console.print(f"step {end.done:>6}  " + "  ".join(f"{k} {v:.4g}" for k, v in scores.items()))
        self.window.restart(end.done)

    def save(self, end: StepEnd) -> None:
        jax.block_until_ready(end.state)
        with self.goodput.charge("checkpoint"):
            self.checkpointer.save(end.state)
            with self.checkpointer.writing():  # a bucket's failure here fails the save, as for its arrays
                self.log.flush()  # the record a resume from this step continues is where the run is
        self.saved = end.done
        self.window.restart(end.done)

    def advance_bar(self, end: StepEnd) -> None:
        self.progress.update(self.bar, completed=end.done)

    def stop_if_asked(self, end: StepEnd) -> None:
        """On SIGTERM/SIGINT: save this step (written in full by the checkpointer's close) and exit 75."""
        if self.stop.reached(end.done) and end.done < end.last:
            if self.saved != end.done:
                self.save(end)
            raise Preempted(
                f"stopped after step {end.done} and saved its checkpoint in {self.cfg.checkpoint_dir}; "
                "run the same command again to continue."
            )
