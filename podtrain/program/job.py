"""A job: a model's task on a mesh, with its state's layout, its jitted steps and its rates.

`build(cfg, mesh, data=False)` needs no data and no weights: the step compiled from abstract shapes
is the very step `train` runs (`podtrain.program.prepare`). `build` takes a config made final for
its mesh (`prepare.final`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
from podtrain.config.schema import Config
from podtrain.data.registry import SOURCES
from podtrain.errors import ConfigError
from podtrain.models import family
from podtrain.program.state import TrainSetup, init_state, train_setup
from podtrain.program.step import make_train_step, mean_over_batches
from podtrain.program.tasks import Task
from podtrain.program.tasks.registry import TASKS, families_of, task_of
from podtrain.sharding import (
    Parallelism,
    batch_sharding,
    data_parallel_size,
    microbatches_over,
    replicated,
    sharded_jit,
    shardings_of,
)
from podtrain.trees import ITEMS, leaf_name


def accumulation(cfg: Config, dp: int, pipelined: int = 1) -> int:
    """Microbatches per step on `dp` data-parallel devices (mesh data x fsdp): the fewest, at least
    train.grad_accum, whose microbatch splits evenly over them and into the `pipelined` microbatches
    of a pipeline and, with train.device_batch, gives no device more sequences than that. The global
    batch and its order are the config's on any number of devices, so a run resumed on fewer (or
    more) still trains step i on batch i."""
    t = cfg.train
    if t.batch_size % dp:
        divisors = [str(n) for n in range(1, t.batch_size + 1) if t.batch_size % n == 0]
        near = sorted({dp * (t.batch_size // dp), dp * (t.batch_size // dp + 1)} - {0})
        raise ConfigError(
            f"train.batch_size={t.batch_size} does not split over {dp} data-parallel devices (mesh data x fsdp). "
            f"Run on a data-parallel size that divides it ({', '.join(divisors[:12])}), or start a new run with a "
            f"batch size that is a multiple of {dp} ({' or '.join(map(str, near))})."
        )
    least = max(t.grad_accum, -(-t.batch_size // (t.device_batch * dp)) if t.device_batch else 1)
    if least > t.batch_size // dp:
        raise ConfigError(
            f"train.grad_accum={t.grad_accum} leaves microbatches of {t.batch_size // t.grad_accum} sequences, fewer "
            f"than the {dp} data-parallel devices (mesh data x fsdp); make it at most {t.batch_size // dp}."
        )
    split = math.lcm(dp, pipelined)
    fits = [a for a in range(least, t.batch_size + 1) if t.batch_size % a == 0 and t.batch_size // a % split == 0]
    if not fits:  # the pipeline runs no batch another way
        raise ConfigError(
            f"train.batch_size={t.batch_size} in at least {least} microbatches (train.grad_accum, train.device_batch) "
            f"leaves none that splits over {dp} data-parallel devices and into pipeline.microbatches={pipelined}; "
            f"make train.batch_size a multiple of {least * split} or lower train.device_batch's demand."
        )
    return fits[0]


def on_mesh(cfg: Config, mesh) -> int:
    """`accumulation` on `mesh`: its data-parallel devices and, over a stage axis, its pipeline's microbatches."""
    stages = mesh.shape["stage"]
    pipelined = microbatches_over(stages, cfg.pipeline.microbatches) if stages > 1 else 1
    return accumulation(cfg, data_parallel_size(mesh), pipelined)


@dataclass
class Job:
    """A model's task compiled on a mesh: the state's layout and first value, the steps, the rates."""

    setup: TrainSetup
    task: Task
    abstract_state: dict  # {"step", "params", "opt"}, with "ema" and the task's "carry" where kept
    step: Callable  # (state, batch) -> (state, metrics)
    eval_step: Callable  # (params, batch) -> metrics
    tokens_per_step: int
    flops_per_step: float

    @property
    def lora(self) -> bool:
        """Whether the job trains LoRA's adapters on a frozen base (which rides beside the state's params)."""
        return "base" in self.abstract_state

    def init_state(self, seed: int, params=None) -> dict:
        state = init_state(self.setup, seed, params)
        return state if self.task.carry is None else {**state, "carry": self.task.initial_carry()}

    @property
    def saved_state(self) -> dict:
        """The items of the state a checkpoint keeps: not the step (its name), nor LoRA's base."""
        return {k: v for k, v in self.abstract_state.items() if k in ITEMS}

    def evaluate(self, params) -> dict:
        return mean_over_batches(self.eval_step, params, self.task.eval_batches)

    @property
    def replicated(self) -> list[str]:
        """Parameters that a mesh axis their rules name does not divide, replicated over it instead."""
        fns = self.setup.fns
        names = jax.tree.leaves(fns.logical_axes, is_leaf=lambda x: isinstance(x, tuple))
        paths = jax.tree_util.tree_flatten_with_path(fns.abstract_params)[0]
        shapes = {leaf_name(path): (axes, s.shape) for (path, s), axes in zip(paths, names)}
        return replicated(shapes, fns.mesh)

    def compile(self):
        """The train step compiled ahead of time from abstract shapes (no weights allocated)."""
        return self.step.lower(self.abstract_state, self.task.train_batch).compile()


def build(cfg: Config, mesh, data: bool = True) -> Job:
    """The model, its optimizer and its task (text for language models, puzzles for reasoners) on
    `mesh`; with data=False the task knows its batches' shapes but reads nothing."""
    if on_mesh(cfg, mesh) != cfg.train.grad_accum:
        raise ValueError("build takes a config made final for its mesh: podtrain.program.prepare.final")
    record = family(cfg.model)
    if data and SOURCES[cfg.data.source].task != record.task:
        readers = families_of(TASKS[SOURCES[cfg.data.source].task])
        raise ConfigError(
            f"data.source={cfg.data.source} is data for model.name={' or '.join(readers)}; model.name="
            f"{cfg.model.name} reads data.source={' or '.join(task_of(record).data_sources)}."
        )
    setup, t = train_setup(cfg, mesh), cfg.train
    task = task_of(record)(cfg, mesh, data)
    fns = setup.fns
    abstract_state = setup.abstract_state if task.carry is None else {**setup.abstract_state, "carry": task.carry}
    after, lora = record.after_step, "base" in abstract_state
    # Under LoRA the base, an MoE router's bias with it, stays as it was.
    after_step = None if after is None or lora else functools.partial(after, cfg.model)
    parallelism = Parallelism.of(cfg)
    step = make_train_step(setup, t, mesh, task.loss_fn, abstract_state, cfg.seed, after_step, parallelism)
    eval_step = sharded_jit(
        lambda params, batch: task.eval_fn(fns.module(params), batch),
        mesh,
        parallelism,
        in_shardings=(shardings_of(fns.abstract_params), batch_sharding(mesh)),
    )
    tokens_per_step = t.batch_size * task.positions
    trained = setup.n_trained
    if lora:  # the base's weights get no gradient, the adapters' do
        per_token = record.flops_per_token(cfg.model, fns.n_params - trained, task.positions, per_weight=4)
        per_token += 6 * trained
    else:
        per_token = record.flops_per_token(cfg.model, fns.n_params, task.positions)
    flops_per_step = per_token * tokens_per_step
    return Job(setup, task, abstract_state, step, eval_step, tokens_per_step, flops_per_step)
