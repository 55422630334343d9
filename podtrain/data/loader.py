"""Windows of seq_len + 1 tokens, shuffled each epoch by grain, batched, and placed on the mesh.

The training dataset is random-access: batch i is the batch of step i, so a resumed run reads
exactly the batches it would have read without stopping.
"""

from __future__ import annotations

import grain
import jax
import numpy as np
from jax.sharding import NamedSharding

from podtrain.errors import DataError


def _windows(tokens: np.ndarray, seq_len: int, batch_size: int, split: str) -> int:
    n = (len(tokens) - 1) // seq_len
    if n < batch_size:
        raise DataError(
            f"The {split} split has {len(tokens)} tokens: {n} windows of train.seq_len={seq_len}, fewer than "
            f"train.batch_size={batch_size}. Use more text, a smaller train.seq_len or train.batch_size."
        )
    return n


def train_dataset(tokens: np.ndarray, seq_len: int, batch_size: int, seed: int) -> grain.MapDataset:
    """Infinite random-access dataset of (batch_size, seq_len + 1) int32 batches."""
    n = _windows(tokens, seq_len, batch_size, "train")
    return (
        grain.MapDataset.range(n)
        .shuffle(seed=seed)
        .repeat()
        .map(lambda i: tokens[i * seq_len : i * seq_len + seq_len + 1].astype(np.int32))
        .batch(batch_size)
    )


def eval_batches(tokens: np.ndarray, seq_len: int, batch_size: int, max_batches: int) -> list[np.ndarray]:
    """The first max_batches full batches of consecutive windows: the same every evaluation."""
    n = _windows(tokens, seq_len, batch_size, "validation")
    n_batches = min(max_batches, n // batch_size)
    starts = np.arange(n_batches * batch_size) * seq_len
    windows = np.stack([tokens[s : s + seq_len + 1] for s in starts]).astype(np.int32)
    return list(windows.reshape(n_batches, batch_size, seq_len + 1))


def global_batch(host_batch: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """One array over the whole mesh from this process's rows of the batch."""
    return jax.make_array_from_process_local_data(sharding, host_batch)
