"""The task interface: what a model learns from and how it is scored.

The state, the train step, accumulation, the optimizer and checkpoints are shared by every model;
a task brings only its data, a loss, an evaluation and a finish hook (torchtitan's TrainSpec is
the model). `loss_fn` and `eval_fn` are module-level pure functions of the model built from the
params, so they can be called, differentiated and tested on their own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from podtrain.config.schema import Config, TrainConfig
from podtrain.data.loader import BatchReader, in_order, shuffled
from podtrain.data.registry import SOURCES
from podtrain.sharding import batch_sharding


class _Sources:
    """`Task.data_sources`: the values of data.source whose record (podtrain.data.registry) names the task."""

    def __get__(self, task, cls) -> tuple[str, ...]:
        return tuple(name for name, source in SOURCES.items() if source.task == cls.name)


class Task:
    """One kind of training. A subclass's __init__(cfg, mesh, data=True) sets:

    train_batch   a train batch's shape, dtype and sharding, (grad_accum, microbatch, ...)
    positions     the positions (tokens, cells) one example trains, for tokens/s and MFU
    carry         what the step keeps per example from one step to the next, as abstract arrays
                  laid out like `train_batch` ({name: jax.ShapeDtypeStruct}), or None
    and, reading the data unless data=False (enough to compile the step):
    summary       one line on the data, printed at the start
    batches       the train batches, indexed by step
    eval_batches  the evaluation batches, (batch, ...)
    tokenizer     text tasks: the tokenizer of the data, which the run keeps a copy of; else None
    """

    # loss_fn(model, carry, microbatch, key) -> (loss, (carry, metrics)): `carry` is this
    # microbatch's slice of the carry, `key` fresh randomness. A metric is a scalar, or a
    # (sum, count) pair that the step pools over microbatches.
    loss_fn: Callable
    # eval_fn(model, batch) -> {metric: mean over the batch}
    eval_fn: Callable

    name: str  # its name in podtrain.program.tasks.registry.TASKS, which model families and data sources give
    train_config: type[TrainConfig] = TrainConfig  # the task's keys under `train.`
    data_sources = _Sources()  # the values of data.source it reads
    train_batch: Any  # jax.ShapeDtypeStruct
    summary: str
    batches: BatchReader
    eval_batches: BatchReader
    positions: int
    tokenizer: Any = None
    carry: dict | None = None

    def initial_carry(self) -> dict | None:
        """The carry's value at step 0, laid out like `carry`."""
        return None

    def start(self, fns, params, run_dir, step: int) -> None:
        """Called once before the first batch is read, with the weights the run starts (or resumes)
        from at `step`: what the task derives from them (DPO's reference) goes into its data here."""
        return None

    def finish(self, fns, params) -> Any:
        """What to show at the end of training (a sample of text), or None."""
        return None


def padded(rows: np.ndarray, size: int) -> np.ndarray:
    """`rows`, then rows of zeros (which train no token) to a whole number of batches of `size`."""
    return np.concatenate([rows, np.zeros((-len(rows) % size, *rows.shape[1:]), rows.dtype)])


def row_readers(
    train: np.ndarray, held_out: np.ndarray, train_batch: jax.ShapeDtypeStruct, mesh, cfg: Config
) -> tuple[BatchReader, BatchReader]:
    """A task's readers of rows in memory: the train rows shuffled each epoch into batches laid out
    like `train_batch`, and the first train.eval_batches whole batches of the held-out rows, in order."""
    t = cfg.train
    batches = BatchReader(
        shuffled(len(train), cfg.seed, train.__getitem__),
        train_batch.sharding,
        train_batch.shape,
        axis=1,
        epoch_size=len(train),
    )
    eval_batches = BatchReader(
        in_order(len(held_out), t.batch_size, t.eval_batches, held_out.__getitem__),
        batch_sharding(mesh),
        (t.batch_size, *held_out.shape[1:]),
        axis=0,
    )
    return batches, eval_batches
