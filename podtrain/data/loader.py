"""Examples (windows of seq_len + 1 tokens, or puzzles), shuffled each epoch by grain, read per
process, placed on the mesh.

Datasets are random-access over examples: example i of batch b is b * examples_per_batch + i,
so a resumed run reads exactly the batches it would have read without stopping, on any number of
processes, and each process reads only the rows its own devices hold. grain reads the batches
ahead of the step, in threads or worker processes; `jax.make_array_from_process_local_data`
joins the processes' rows into one global batch.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grain
import jax
import numpy as np
from jax.sharding import NamedSharding

from podtrain.errors import DataError, MeshError

# Threads reading a batch's rows where each may wait on a request (shards in a bucket beyond the block
# cache): up to 16 requests in flight. Rows from memory are read in turn: handing one to a thread costs more.
REMOTE_READERS = 16


@functools.cache
def _reading_pool(threads: int) -> ThreadPoolExecutor:
    """One pool a process (a loader worker has its own), kept: starting threads per batch costs more than a
    cached batch takes to read."""
    return ThreadPoolExecutor(threads, thread_name_prefix="podtrain-rows")


def _count_windows(tokens: np.ndarray, seq_len: int, batch_size: int, split: str) -> int:
    n = (len(tokens) - 1) // seq_len
    if n < batch_size:
        raise DataError(
            f"The {split} split has {len(tokens)} tokens: {n} windows of train.seq_len={seq_len}, fewer than "
            f"train.batch_size={batch_size}. Use more text, a smaller train.seq_len or train.batch_size."
        )
    return n


def _window(tokens: np.ndarray, seq_len: int):
    return lambda i: tokens[i * seq_len : i * seq_len + seq_len + 1].astype(np.int32)


def shuffled(n: int, seed: int, example) -> grain.MapDataset:
    """Infinite random-access dataset of example(i) for i < n, reshuffled every epoch."""
    return grain.MapDataset.range(n).shuffle(seed=seed).repeat().map(example)


def in_order(n: int, batch_size: int, max_batches: int, example) -> grain.MapDataset:
    """example(i) for the first of n in at most max_batches full batches: the same every evaluation."""
    return grain.MapDataset.range(min(max_batches, n // batch_size) * batch_size).map(example)


def train_windows(tokens, seq_len: int, batch_size: int, seed: int) -> tuple[grain.MapDataset, int]:
    """An infinite random-access dataset of (seq_len + 1,) int32 windows, reshuffled every epoch,
    and the windows per epoch. Window i starts at token i * seq_len: packed end to end, each token
    of an epoch is predicted once, but for the last partial window's."""
    n = _count_windows(tokens, seq_len, batch_size, "train")
    return shuffled(n, seed, _window(tokens, seq_len)), n


def eval_windows(tokens, seq_len: int, batch_size: int, max_batches: int) -> grain.MapDataset:
    """The consecutive windows of at most max_batches full batches."""
    return in_order(
        _count_windows(tokens, seq_len, batch_size, "validation"), batch_size, max_batches, _window(tokens, seq_len)
    )


def process_rows(sharding: NamedSharding, shape: tuple[int, ...], axis: int) -> np.ndarray:
    """Indices along `axis` of a global array of `shape` that this process's devices hold."""
    spans = {index[axis].indices(shape[axis])[:2] for index in sharding.addressable_devices_indices_map(shape).values()}
    lo, hi = min(s for s, _ in spans), max(e for _, e in spans)
    if len(set().union(*(range(s, e) for s, e in spans))) != hi - lo:
        raise MeshError(
            f"This process's devices hold non-contiguous rows {sorted(spans)} of the batch; build the mesh from "
            "jax.devices() in their default order."
        )
    return np.arange(lo, hi)


@dataclass(frozen=True)
class LocalRows:
    """Reads this process's rows of a batch; holds no devices, so loader workers can unpickle it."""

    windows: grain.MapDataset
    per_batch: int
    offsets: np.ndarray  # of this process's rows within a batch
    readers: int = 1  # threads reading a batch's rows at once: many where each row may wait on a bucket

    def ids(self, batch: int) -> np.ndarray:
        return batch * self.per_batch + self.offsets

    def _read(self, i) -> np.ndarray:
        return self.windows[int(i)]

    def __call__(self, batch: int) -> np.ndarray:
        ids = self.ids(batch)
        if self.readers > 1:
            examples = np.stack(list(_reading_pool(self.readers).map(self._read, ids.ravel())))
        else:
            examples = np.stack([self._read(i) for i in ids.ravel()])
        return examples.reshape(*ids.shape, *examples.shape[1:])


class BatchReader:
    """Global batches of `shape` from a windows dataset; dimension `axis` is split over data-parallel devices.

    Each batch holds prod(shape[: axis + 1]) windows in row-major order; this process reads
    only the rows along `axis` that its devices hold (every row where the batch is replicated).
    """

    def __init__(
        self,
        windows: grain.MapDataset,
        sharding: NamedSharding,
        shape: tuple[int, ...],
        axis: int,
        epoch_size: int | None = None,
        readers: int = 1,
    ):
        self.windows, self.sharding, self.shape, self.epoch_size = windows, sharding, tuple(shape), epoch_size
        self.per_batch = math.prod(shape[: axis + 1])
        rows = process_rows(sharding, self.shape, axis)
        leading = np.arange(math.prod(shape[:axis]))[:, None] * shape[axis]
        offsets = (leading + rows[None, :]).reshape(*shape[:axis], len(rows))
        self.local = LocalRows(windows, self.per_batch, offsets, readers)

    def __len__(self) -> int:
        return len(self.windows) // self.per_batch

    def ids(self, batch: int) -> np.ndarray:
        """Window ids this process reads for `batch`."""
        return self.local.ids(batch)

    def __getitem__(self, batch: int) -> jax.Array:
        return self.place(self.local(batch))

    def place(self, local: np.ndarray) -> jax.Array:
        return jax.make_array_from_process_local_data(self.sharding, local, self.shape)

    def epoch(self, batch: int) -> int:
        """The epoch that batch `batch` is read in (the examples of its first row)."""
        return batch * self.per_batch // self.epoch_size

    def stream(self, start: int, stop: int, workers: int = 0, prefetch: int = 2) -> Iterator[jax.Array]:
        """Batches start..stop-1, each read `prefetch` batches ahead of its use, by as many threads,
        or by `workers` processes; the same batches as indexing, on any number of processes."""
        local = grain.MapDataset.range(start, stop).map(self.local)
        ahead = local.to_iter_dataset(grain.ReadOptions(num_threads=prefetch, prefetch_buffer_size=prefetch))
        if workers:
            from absl import flags

            if not flags.FLAGS.is_parsed():  # grain's workers read absl flags, which only a main() built on absl parses
                flags.FLAGS.mark_as_parsed()
            ahead = ahead.mp_prefetch(
                grain.MultiprocessingOptions(num_workers=workers, per_worker_buffer_size=max(1, prefetch))
            )
        reading = iter(ahead)
        try:
            for rows in reading:
                yield self.place(rows)
        finally:  # stops the threads or worker processes, also when the loop leaves early
            reading.close()
