"""Language modelling: next-token loss on windows of packed documents, validation loss, a sample at the end;
chat fine-tuning on the assistant's tokens; preference tuning (DPO, tasks/preference.py) on pairs of replies."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from podtrain.config.keys import key
from podtrain.config.schema import Config, TrainConfig
from podtrain.data import chat, pairs
from podtrain.data.loader import REMOTE_READERS, BatchReader, eval_windows, train_windows
from podtrain.data.registry import SOURCES, Format
from podtrain.errors import ConfigError, DataError
from podtrain.program.sampler import Sampling, complete
from podtrain.program.tasks import Task, padded, preference, row_readers
from podtrain.sharding import batch_sharding, context_order, positions_of, reordered


@dataclass
class TextTrainConfig(TrainConfig):
    """Language modelling: the window length, the objective and the closing sample."""

    seq_len: int = key(256, "tokens per training window", ">= 1")
    objective: str = key(
        "lm",
        "lm: next-token cross entropy; dpo: preference tuning (DPO) on data.format=pairs, the reference being the "
        "starting weights",
    )
    dpo_beta: float = key(0.1, "DPO's beta: how far the rewards' margin is scaled (the KL penalty's weight)", "> 0")
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


def chunked_cross_entropy(
    logits_fn, x_BTD: jax.Array, targets: jax.Array, chunk: int, weights: jax.Array | None = None
) -> jax.Array:
    """cross_entropy(logits_fn(x), targets), `chunk` positions at a time in a loop whose body is
    recomputed in the backward pass: only one chunk's float32 logits (batch, chunk, vocab) exist
    at once, never the whole sequence's. A last, shorter chunk is padded and its padding not counted.
    With `weights` (batch, seq), the weighted mean."""
    total = chunked_token_sums(logits_fn, x_BTD, targets, chunk, weights).sum()
    b, t = targets.shape
    return total / (b * t) if weights is None else total / jnp.maximum(weights.astype(jnp.float32).sum(), 1)


def chunked_token_sums(
    logits_fn, x_BTD: jax.Array, targets: jax.Array, chunk: int, weights: jax.Array | None = None
) -> jax.Array:
    """Per sequence (batch,), the (weighted) sum of its tokens' cross entropies, in chunks as
    `chunked_cross_entropy` takes them."""
    b, t, d = x_BTD.shape
    n = -(-t // chunk)
    pad = n * chunk - t
    w = jnp.ones((b, t), jnp.float32) if weights is None else weights.astype(jnp.float32)
    chunks = (  # (n, batch, chunk, ...): the loop runs over the first axis, the batch keeps its sharding
        jnp.pad(x_BTD, ((0, 0), (0, pad), (0, 0))).reshape(b, n, chunk, d).swapaxes(0, 1),
        jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, n, chunk).swapaxes(0, 1),
        jnp.pad(w, ((0, 0), (0, pad))).reshape(b, n, chunk).swapaxes(0, 1),
    )

    @jax.checkpoint
    def chunk_sums(xs):
        x, target, w = xs
        return (token_losses(logits_fn(x), target) * w).sum(-1)  # (batch,)

    return jax.lax.map(chunk_sums, chunks).sum(0)


def document_ids(tokens: jax.Array, eos_id: int) -> jax.Array:
    """Per token, the count of EOS tokens before it: a document's EOS ends that document, and the
    token after it starts the next one."""
    is_eos = (tokens == eos_id).astype(jnp.int32)
    return jnp.cumsum(is_eos, axis=-1) - is_eos


def document_positions(segment_ids: jax.Array) -> jax.Array:
    """(batch, seq): each token's place in its own segment, counting from 0 where the segment starts."""
    index = positions_of(segment_ids.shape)
    starts = jnp.concatenate(
        [jnp.ones_like(segment_ids[..., :1], bool), segment_ids[..., 1:] != segment_ids[..., :-1]], axis=-1
    )
    return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=segment_ids.ndim - 1)


def sequence_loss(model, inputs, targets, segments=None, weights=None, reset_positions: bool = False, score=None):
    """(the model's cross entropy, its auxiliary terms) on windows (batch, seq) of inputs and
    targets, each token attending only within its segment (if `segments`), at positions that
    restart with each (`reset_positions`). Where the mesh splits the sequence (context
    parallelism), the tokens are put in the order that gives every shard the same causal work,
    with their positions: the loss, a mean, is the same in any order. `score` (`scored`'s
    arguments) may reduce the token losses otherwise, in a way that order does not change."""
    positions = document_positions(segments) if reset_positions and segments is not None else None
    if (order := context_order(inputs.shape[1])) is not None:
        positions = positions_of(inputs.shape) if positions is None else positions
        inputs, targets, segments, positions, weights = reordered(order, inputs, targets, segments, positions, weights)
    table, x, aux = model.features(inputs, segments, positions)
    return (score or scored)(model, table, x, targets, weights), aux


def trained(cross_entropy: jax.Array, aux: dict) -> tuple[jax.Array, dict]:
    """The loss to train and the metrics beside it: the cross entropy plus the model's own
    auxiliary loss (an MoE's balancing terms), whose parts are logged."""
    metrics = {k: v for k, v in aux.items() if k != "loss"}
    return (cross_entropy + aux["loss"] if "loss" in aux else cross_entropy), metrics


def next_token_loss(model, carry, tokens: jax.Array, key, eos_id: int | None = None, reset_positions: bool = False):
    """The mean cross entropy of predicting each token of windows (batch, seq + 1) from those
    before it; with `eos_id`, only from those of its own document (data.pack=documents). With
    model.loss_chunk, the logits are made and scored that many positions at a time."""
    loss, metrics = trained(*window_loss(model, tokens, eos_id, reset_positions))
    return loss, (carry, metrics)


def window_loss(model, tokens: jax.Array, eos_id: int | None = None, reset_positions: bool = False):
    """`sequence_loss` of windows (batch, seq + 1), each token predicted from those before it."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    segments = None if eos_id is None else document_ids(inputs, eos_id)
    return sequence_loss(model, inputs, targets, segments, None, reset_positions)


def token_sums(model, table, x: jax.Array, targets: jax.Array, weights: jax.Array) -> jax.Array:
    """Per sequence (batch,), the weighted sum of its tokens' cross entropies, in chunks of
    model.loss_chunk positions if set."""
    chunk = model.cfg.loss_chunk
    if chunk and chunk < x.shape[1]:
        return chunked_token_sums(lambda x: model.logits(table, x), x, targets, chunk, weights)
    return (token_losses(model.logits(table, x), targets) * weights.astype(jnp.float32)).sum(-1)


def reply_log_probs(model, rows: jax.Array):
    """(the summed log-probability of each pair's chosen and rejected reply (batch, 2), the model's
    auxiliary terms) of preference pairs, rows (batch, 2, 3, seq + 1) as data/pairs.py lays them out."""
    b, _, _, length = rows.shape
    tokens, learned = (rows[:, :, channel].reshape(2 * b, length) for channel in (pairs.TOKENS, pairs.TRAINED))
    sums, aux = sequence_loss(model, tokens[:, :-1], tokens[:, 1:], None, learned[:, 1:], score=token_sums)
    return -sums.reshape(b, 2), aux


def scored(model, table, x: jax.Array, targets: jax.Array, weights: jax.Array | None = None) -> jax.Array:
    """The mean cross entropy of the model's logits of x against targets (weighted by `weights`),
    in chunks of model.loss_chunk positions if set."""
    chunk = model.cfg.loss_chunk
    if chunk and chunk < x.shape[1]:
        return chunked_cross_entropy(lambda x: model.logits(table, x), x, targets, chunk, weights)
    if weights is None:
        return cross_entropy(model.logits(table, x), targets)
    w = weights.astype(jnp.float32)
    return (token_losses(model.logits(table, x), targets) * w).sum() / jnp.maximum(w.sum(), 1)


def chat_loss(model, carry, rows: jax.Array, key, reset_positions: bool = False):
    """The mean cross entropy of the assistant's tokens of packed conversations, rows (batch, 3,
    seq + 1) as data/chat.py packs them: each token predicted from the earlier tokens of its own
    conversation, which attends to nothing outside it."""
    loss, metrics = trained(*chat_sequence_loss(model, rows, reset_positions))
    return loss, (carry, metrics)


def chat_sequence_loss(model, rows: jax.Array, reset_positions: bool = False):
    """`sequence_loss` of packed conversations, counting the assistant's tokens only."""
    tokens, segments, learned = rows[:, chat.TOKENS], rows[:, chat.SEGMENTS], rows[:, chat.TRAINED]
    weights = learned[:, 1:] * (segments[:, 1:] == segments[:, :-1])
    return sequence_loss(model, tokens[:, :-1], tokens[:, 1:], segments[:, :-1], weights, reset_positions)


def validation_loss(model, tokens: jax.Array, eos_id: int | None = None, reset_positions: bool = False) -> dict:
    """The held-out tokens' cross entropy (no auxiliary loss)."""
    return {"val_loss": window_loss(model, tokens, eos_id, reset_positions)[0]}


def chat_validation_loss(model, rows: jax.Array, reset_positions: bool = False) -> dict:
    """The held-out assistant tokens' cross entropy."""
    return {"val_loss": chat_sequence_loss(model, rows, reset_positions)[0]}


class LanguageTask(Task):
    name = "language"
    train_config = TextTrainConfig
    loss_fn = staticmethod(next_token_loss)
    eval_fn = staticmethod(validation_loss)
    preferences: preference.Preferences | None = None  # data.format=pairs
    prompt: chat.Renderer | None = None  # a format of conversations: its template, which the closing sample takes

    def __init__(self, cfg: Config, mesh: Mesh, data: bool = True):
        t, form = cfg.train, FORMATS[cfg.data.format]
        self.cfg, self.positions = cfg, form.sequences * t.seq_len
        if t.seq_len % (2 * mesh.shape["context"]):
            raise ConfigError(
                f"train.seq_len={t.seq_len} does not split into 2 x {mesh.shape['context']} equal chunks, one pair per "
                f"context shard (mesh.context={mesh.shape['context']}); make it a multiple of "
                f"{2 * mesh.shape['context']}."
            )
        self.train_batch = jax.ShapeDtypeStruct(
            (t.grad_accum, t.batch_size // t.grad_accum, *form.channels, t.seq_len + 1),
            jnp.int32,
            sharding=batch_sharding(mesh, leading=1),
        )
        if form.losses is not None:
            self.loss_fn, self.eval_fn = form.losses(cfg)
        elif not data and cfg.data.pack == "documents":  # shapes only: the cost is the same whichever id ends one
            self.loss_fn = partial(next_token_loss, eos_id=0, reset_positions=cfg.data.reset_positions)
        if not data:
            return
        source = SOURCES[cfg.data.source]
        self.tokenizer = source.tokenizer(cfg.data)
        largest = source.max_id(cfg.data, self.tokenizer)
        if cfg.model.vocab_size <= largest:
            raise DataError(
                f"The data holds token ids up to {largest} (tokenizer {self.tokenizer.spec}), out of range for "
                f"model.vocab_size={cfg.model.vocab_size}; set model.vocab_size=auto or a number above {largest}."
            )
        form.read(self, mesh)

    def _read_text(self, mesh: Mesh) -> None:
        """Windows of documents packed in order (kept apart by their EOS with data.pack=documents)."""
        t, cfg = self.cfg.train, self.cfg
        if cfg.data.pack == "documents":
            if self.tokenizer.eos_id is None:
                raise ConfigError(
                    "data.pack=documents finds documents by their EOS token, which the tokenizer "
                    f"{self.tokenizer.spec} does not have; use data.pack=concat or a tokenizer with one."
                )
            self.loss_fn, self.eval_fn = (
                partial(fn, eos_id=self.tokenizer.eos_id, reset_positions=cfg.data.reset_positions)
                for fn in (next_token_loss, validation_loss)
            )
        train_tokens, val_tokens = SOURCES[cfg.data.source].tokens(cfg.data, self.tokenizer)
        windows, n = train_windows(train_tokens, t.seq_len, t.batch_size, cfg.seed)
        self.summary = (
            f"{len(train_tokens):,} train / {len(val_tokens):,} val tokens ({self.tokenizer.spec}); "
            f"an epoch is {n // t.batch_size:,} steps"
        )
        readers = [
            REMOTE_READERS if getattr(tokens, "beyond_cache", False) else 1 for tokens in (train_tokens, val_tokens)
        ]
        self.batches = BatchReader(
            windows, self.train_batch.sharding, self.train_batch.shape, axis=1, epoch_size=n, readers=readers[0]
        )
        self.eval_batches = BatchReader(
            eval_windows(val_tokens, t.seq_len, t.batch_size, t.eval_batches),
            batch_sharding(mesh),
            (t.batch_size, t.seq_len + 1),
            axis=0,
            readers=readers[1],
        )

    def _read_chat(self, mesh: Mesh) -> None:
        """Packed rows of conversations (data/chat.py), shuffled each epoch; the held-out rows
        padded with untrained rows to whole batches."""
        t, data = self.cfg.train, self.cfg.data
        train, val, summary = chat.chat_rows(data.path, self.tokenizer, t.seq_len + 1, data.val_fraction)
        if len(train) < t.batch_size:
            raise DataError(
                f"The conversations fill {len(train)} rows of train.seq_len + 1 = {t.seq_len + 1} tokens, fewer than "
                f"train.batch_size={t.batch_size}; use more conversations, a smaller train.batch_size or seq_len."
            )
        self.summary = f"{summary} ({self.tokenizer.spec}); an epoch is {len(train) // t.batch_size:,} steps"
        self.batches, self.eval_batches = row_readers(
            train, padded(val, t.batch_size), self.train_batch, mesh, self.cfg
        )
        self.prompt = chat.Renderer.of(self.tokenizer)

    def _read_pairs(self, mesh: Mesh) -> None:
        """Preference pairs (data/pairs.py), whose rows `start` gives the reference's log-probabilities."""
        self.preferences = preference.Preferences(self.cfg, mesh, self.tokenizer, self.train_batch, reply_log_probs)
        self.summary = f"{self.preferences.summary} ({self.tokenizer.spec})"
        self.batches, self.eval_batches = self.preferences.batches, self.preferences.eval_batches
        self.prompt = chat.Renderer.of(self.tokenizer)

    def start(self, fns, params, run_dir, step: int) -> None:
        """DPO: the reference's log-probabilities into the pairs' rows, and how it ranks them into the summary."""
        if self.preferences is not None:
            self.summary += "; " + self.preferences.start(fns, params, run_dir, step)

    def finish(self, fns, params) -> str | None:
        """A sample of text, run on every process: the params span them all. For conversations, the
        reply to a greeting."""
        t = self.cfg.train
        if not t.sample_tokens:
            return None
        prompt = "The "
        if self.prompt is not None:
            prompt = self.prompt([{"role": "user", "content": "Hello! Who are you?"}], generation_prompt=True)
        options = {"seeds": [self.cfg.seed], "max_len": t.seq_len}
        return prompt + complete(fns, params, self.tokenizer, [prompt], t.sample_tokens, Sampling(0.8), **options)[0]


def _chat_losses(cfg: Config) -> tuple[Callable, Callable]:
    reset = cfg.data.reset_positions
    return partial(chat_loss, reset_positions=reset), partial(chat_validation_loss, reset_positions=reset)


def _dpo_losses(cfg: Config) -> tuple[Callable, Callable]:
    beta = cfg.train.dpo_beta
    return tuple(
        partial(fn, log_probs=reply_log_probs, beta=beta) for fn in (preference.dpo_loss, preference.dpo_validation)
    )


# The values of data.format (each a podtrain.data.registry.Format), which the checks and the docs read too.
FORMATS: dict[str, Format] = {
    "text": Format(
        "documents to model whole, packed by data.pack", "documents to model whole", LanguageTask._read_text
    ),
    "chat": Format(
        'conversations, a JSONL line each ({"messages": [{role, content}]}), rendered with the tokenizer\'s chat '
        "template, trained on the assistant's tokens only, packed apart",
        "conversations from a JSONL file or folder",
        LanguageTask._read_chat,
        channels=(3,),  # their channels: data/chat.py
        sources=("text",),
        apart=True,
        path_on_read=True,  # an imported run's config leaves them to set
        losses=_chat_losses,
    ),
    "pairs": Format(
        'preference pairs, a JSONL line and a row each ({"prompt" or "messages", "chosen", "rejected"})',
        "preference pairs from a JSONL file or folder",
        LanguageTask._read_pairs,
        channels=(2, 3),  # data/pairs.py
        sequences=2,  # its chosen and its rejected reply
        sources=("text",),
        objective="dpo",
        losses=_dpo_losses,
    ),
}
