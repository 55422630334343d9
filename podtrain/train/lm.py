"""Language modelling: next-token loss on windows of byte-level text, validation loss, a sample at the end."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from podtrain.config import Config
from podtrain.data.loader import BatchReader, eval_windows, train_windows
from podtrain.data.text import load_tokens
from podtrain.errors import ConfigError, DataError
from podtrain.train.sample import sample
from podtrain.train.step import batch_sharding
from podtrain.train.task import Task

BYTE_VOCAB = 256


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean of logsumexp(logits) - logits[target]. The target's logit is picked by comparing with
    the vocabulary's indices, not gathered, so logits split over the vocabulary (tensor
    parallelism) stay split: each shard reduces its part and only per-token sums cross devices."""
    logits = logits.astype(jnp.float32)
    target_logit = jnp.where(jnp.arange(logits.shape[-1]) == targets[..., None], logits, 0.0).sum(-1)
    return (jax.nn.logsumexp(logits, axis=-1) - target_logit).mean()


def next_token_loss(model, carry, tokens: jax.Array, key):
    """The mean cross entropy of predicting each token of windows (batch, seq + 1) from those before it."""
    return cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]), (carry, {})


def validation_loss(model, tokens: jax.Array) -> dict:
    return {"val_loss": next_token_loss(model, None, tokens, None)[0]}


class LanguageTask(Task):
    loss_fn = staticmethod(next_token_loss)
    eval_fn = staticmethod(validation_loss)

    def __init__(self, cfg: Config, mesh: Mesh):
        t = cfg.train
        if cfg.data.source == "sudoku":
            raise ConfigError(f"data.source=sudoku holds puzzles for model.name=hrm or trm, not text for model.name={cfg.model.name}; use data.source=pydoc or text.")
        if cfg.model.vocab_size < BYTE_VOCAB:
            raise DataError(f"Byte-level text has token ids up to {BYTE_VOCAB - 1}, out of range for model.vocab_size={cfg.model.vocab_size}; set model.vocab_size>={BYTE_VOCAB}.")
        train_tokens, val_tokens = load_tokens(cfg.data)
        self.cfg = cfg
        self.summary = f"{len(train_tokens):,} train / {len(val_tokens):,} val tokens"
        micro = t.batch_size // t.grad_accum
        self.batches = BatchReader(train_windows(train_tokens, t.seq_len, t.batch_size, cfg.seed), batch_sharding(mesh, leading=1), (t.grad_accum, micro, t.seq_len + 1), axis=1)
        self.eval_batches = BatchReader(eval_windows(val_tokens, t.seq_len, t.batch_size, t.eval_batches), batch_sharding(mesh), (t.batch_size, t.seq_len + 1), axis=0)
        self.positions = t.seq_len

    def finish(self, fns, params) -> str | None:
        """A sample of text, run on every process: the params span them all."""
        t = self.cfg.train
        if not t.sample_tokens:
            return None
        return "The " + sample(fns, params, "The ", t.sample_tokens, 0.8, t.seq_len, self.cfg.seed)
