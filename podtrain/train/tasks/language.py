"""Language modelling: next-token loss on windows of packed documents, validation loss, a sample at the end."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from podtrain.config.schema import Config, TrainConfig, key
from podtrain.data.loader import BatchReader, eval_windows, train_windows
from podtrain.data.text import data_tokenizer, load_tokens, max_token_id
from podtrain.errors import ConfigError, DataError
from podtrain.sharding import batch_sharding
from podtrain.train.tasks import Task
from podtrain.train.tasks.sampling import sample


@dataclass
class TextTrainConfig(TrainConfig):
    """Language modelling: the window length and the closing sample."""

    seq_len: int = key(256, "tokens per training window", ">= 1")
    sample_tokens: int = key(200, "tokens of text sampled from the model at the end; 0: none", ">= 0")


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean of logsumexp(logits) - logits[target]."""
    return token_losses(logits, targets).mean()


def token_losses(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """logsumexp(logits) - logits[target] per position. The target's logit is picked by comparing
    with the vocabulary's indices, not gathered, so logits split over the vocabulary (tensor
    parallelism) stay split: each shard reduces its part and only per-token sums cross devices."""
    logits = logits.astype(jnp.float32)
    vocab = jnp.arange(logits.shape[-1]).reshape((1,) * targets.ndim + (-1,))
    target_logit = jnp.where(vocab == targets[..., None], logits, 0.0).sum(-1)
    return jax.nn.logsumexp(logits, axis=-1) - target_logit


def chunked_cross_entropy(logits_fn, x_BTD: jax.Array, targets: jax.Array, chunk: int) -> jax.Array:
    """cross_entropy(logits_fn(x), targets), `chunk` positions at a time in a loop whose body is
    recomputed in the backward pass: only one chunk's float32 logits (batch, chunk, vocab) exist
    at once, never the whole sequence's. A last, shorter chunk is padded and its padding not counted."""
    b, t, d = x_BTD.shape
    n = -(-t // chunk)
    pad = n * chunk - t
    counted = jnp.arange(n * chunk) < t
    chunks = (  # (n, batch, chunk, ...): the loop runs over the first axis, the batch keeps its sharding
        jnp.pad(x_BTD, ((0, 0), (0, pad), (0, 0))).reshape(b, n, chunk, d).swapaxes(0, 1),
        jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, n, chunk).swapaxes(0, 1),
        counted.reshape(n, 1, chunk),
    )

    @jax.checkpoint
    def chunk_sum(xs):
        x, target, keep = xs
        return jnp.where(keep, token_losses(logits_fn(x), target), 0.0).sum()

    return jax.lax.map(chunk_sum, chunks).sum() / (b * t)


def document_ids(tokens: jax.Array, eos_id: int) -> jax.Array:
    """Per token, the count of EOS tokens before it: a document's EOS ends that document, and the
    token after it starts the next one."""
    is_eos = (tokens == eos_id).astype(jnp.int32)
    return jnp.cumsum(is_eos, axis=-1) - is_eos


def next_token_loss(model, carry, tokens: jax.Array, key, eos_id: int | None = None):
    """The mean cross entropy of predicting each token of windows (batch, seq + 1) from those
    before it; with `eos_id`, only from those of its own document (data.pack=documents). With
    model.loss_chunk, the logits are made and scored that many positions at a time."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    table, x = model.features(inputs, None if eos_id is None else document_ids(inputs, eos_id))
    chunk = model.cfg.loss_chunk
    if chunk and chunk < inputs.shape[1]:
        return chunked_cross_entropy(lambda x: model.logits(table, x), x, targets, chunk), (carry, {})
    return cross_entropy(model.logits(table, x), targets), (carry, {})


def validation_loss(model, tokens: jax.Array, eos_id: int | None = None) -> dict:
    return {"val_loss": next_token_loss(model, None, tokens, None, eos_id)[0]}


class LanguageTask(Task):
    train_config = TextTrainConfig
    data_sources = ("pydoc", "text", "tokens")
    loss_fn = staticmethod(next_token_loss)
    eval_fn = staticmethod(validation_loss)

    def __init__(self, cfg: Config, mesh: Mesh, data: bool = True):
        t = cfg.train
        self.cfg, self.positions = cfg, t.seq_len
        self.train_batch = jax.ShapeDtypeStruct(
            (t.grad_accum, t.batch_size // t.grad_accum, t.seq_len + 1),
            jnp.int32,
            sharding=batch_sharding(mesh, leading=1),
        )
        if not data:  # shapes only: the document mask costs the same whichever id ends a document
            if cfg.data.pack == "documents":
                self.loss_fn = partial(next_token_loss, eos_id=0)
            return
        self.tokenizer = data_tokenizer(cfg.data)
        largest = max_token_id(cfg.data, self.tokenizer)
        if cfg.model.vocab_size <= largest:
            raise DataError(
                f"The data holds token ids up to {largest} (tokenizer {self.tokenizer.spec}), out of range for "
                f"model.vocab_size={cfg.model.vocab_size}; set model.vocab_size=auto or a number above {largest}."
            )
        if cfg.data.pack == "documents":
            if self.tokenizer.eos_id is None:
                raise ConfigError(
                    "data.pack=documents finds documents by their EOS token, which the tokenizer "
                    f"{self.tokenizer.spec} does not have; use data.pack=concat or a tokenizer with one."
                )
            self.loss_fn, self.eval_fn = (
                partial(next_token_loss, eos_id=self.tokenizer.eos_id),
                partial(validation_loss, eos_id=self.tokenizer.eos_id),
            )
        train_tokens, val_tokens = load_tokens(cfg.data, self.tokenizer)
        windows, n = train_windows(train_tokens, t.seq_len, t.batch_size, cfg.seed)
        self.summary = (
            f"{len(train_tokens):,} train / {len(val_tokens):,} val tokens ({self.tokenizer.spec}); "
            f"an epoch is {n // t.batch_size:,} steps"
        )
        self.batches = BatchReader(windows, self.train_batch.sharding, self.train_batch.shape, axis=1, epoch_size=n)
        self.eval_batches = BatchReader(
            eval_windows(val_tokens, t.seq_len, t.batch_size, t.eval_batches),
            batch_sharding(mesh),
            (t.batch_size, t.seq_len + 1),
            axis=0,
        )

    def finish(self, fns, params) -> str | None:
        """A sample of text, run on every process: the params span them all."""
        t = self.cfg.train
        if not t.sample_tokens:
            return None
        return "The " + sample(fns, params, self.tokenizer, "The ", t.sample_tokens, 0.8, t.seq_len, self.cfg.seed)
