"""Language modelling: next-token loss on windows of byte-level text, validation loss, a sample at the end."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from podtrain.config import Config
from podtrain.data.loader import BatchReader, eval_windows, train_windows
from podtrain.data.text import load_tokens
from podtrain.errors import ConfigError, DataError
from podtrain.models import flops_per_token
from podtrain.runtime.mesh import sharded_jit
from podtrain.train.sample import sample
from podtrain.train.state import TrainSetup, init_state, shardings_of, weights
from podtrain.train.step import batch_sharding, make_train_step, mean_over_batches

BYTE_VOCAB = 256


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean of logsumexp(logits) - logits[target]. The target's logit is picked by comparing with
    the vocabulary's indices, not gathered, so logits split over the vocabulary (tensor
    parallelism) stay split: each shard reduces its part and only per-token sums cross devices."""
    logits = logits.astype(jnp.float32)
    target_logit = jnp.where(jnp.arange(logits.shape[-1]) == targets[..., None], logits, 0.0).sum(-1)
    return (jax.nn.logsumexp(logits, axis=-1) - target_logit).mean()


class LanguageTask:
    """What the training loop needs for a language model: data, step, evaluation, a closing sample."""

    def __init__(self, cfg: Config, setup: TrainSetup, mesh: Mesh):
        t, fns = cfg.train, setup.fns
        if cfg.data.source == "sudoku":
            raise ConfigError(f"data.source=sudoku holds puzzles for model.name=hrm or trm, not text for model.name={cfg.model.name}; use data.source=pydoc or text.")
        if cfg.model.vocab_size < BYTE_VOCAB:
            raise DataError(f"Byte-level text has token ids up to {BYTE_VOCAB - 1}, out of range for model.vocab_size={cfg.model.vocab_size}; set model.vocab_size>={BYTE_VOCAB}.")
        train_tokens, val_tokens = load_tokens(cfg.data)
        self.cfg, self.fns = cfg, fns
        self.summary = f"{len(train_tokens):,} train / {len(val_tokens):,} val tokens"
        self.abstract_state = setup.abstract_state
        self.init_state = lambda: init_state(setup, cfg.seed)

        def next_token_loss(params, tokens):
            return cross_entropy(fns.apply(params, tokens[:, :-1]), tokens[:, 1:])

        def loss_fn(params, carry, tokens, key):
            return next_token_loss(params, tokens), (carry, {})

        self.step = make_train_step(setup, t, mesh, loss_fn, self.abstract_state, cfg.seed)
        micro = t.batch_size // t.grad_accum
        self.batches = BatchReader(train_windows(train_tokens, t.seq_len, t.batch_size, cfg.seed), batch_sharding(mesh, leading=1), (t.grad_accum, micro, t.seq_len + 1), axis=1)
        self.val = BatchReader(eval_windows(val_tokens, t.seq_len, t.batch_size, t.eval_batches), batch_sharding(mesh), (t.batch_size, t.seq_len + 1), axis=0)
        self.eval_step = sharded_jit(lambda params, tokens: {"val_loss": next_token_loss(params, tokens)}, mesh, in_shardings=(shardings_of(fns.abstract_params), batch_sharding(mesh)))
        self.tokens_per_step = t.batch_size * t.seq_len
        self.flops_per_step = flops_per_token(cfg.model, fns.n_params, t.seq_len) * self.tokens_per_step

    def evaluate(self, params) -> dict:
        return mean_over_batches(self.eval_step, params, self.val)

    def finish(self, state) -> str | None:
        """A sample of text, run on every process: the params span them all."""
        t = self.cfg.train
        if not t.sample_tokens:
            return None
        return "The " + sample(self.fns, weights(state), "The ", t.sample_tokens, 0.8, t.seq_len, self.cfg.seed)
