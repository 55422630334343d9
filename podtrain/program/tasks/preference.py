"""Preference tuning (`train.objective=dpo`): DPO (Rafailov et al. 2023) on pairs of replies
(`data.format=pairs`, data/pairs.py).

A pair's loss is -log sigmoid(beta ((pi_c - ref_c) - (pi_r - ref_r))), pi and ref the summed
log-probabilities of the chosen (c) and rejected (r) reply's tokens under the model and under the
reference, averaged over pairs. The reference is the starting weights (under LoRA the base: the
adapters' B start at zero), run once over every pair before the first step, as TRL's
`precompute_ref_log_probs` does: no second model is kept in memory, and the loss stays a function of
the model and the batch, whose rows carry the reference's values. They are kept in
RUN_DIR/dpo_reference.npz, which a resumed run reads back: its weights are no longer the reference.

Logged: `dpo_margin`, the mean of beta (pi_c - ref_c) - beta (pi_r - ref_r), and `dpo_accuracy`,
the share of pairs with a positive margin (0 at the start, where the model is the reference, up to
rounding); on the held-out pairs `val_loss`, `val_dpo_margin`, `val_dpo_accuracy` and
`val_chosen_likelier`, the share of pairs whose chosen reply the model finds likelier than the
rejected one (pi_c > pi_r). The reference's own share is where that started: the run's first line
gives it.
"""

from __future__ import annotations

import hashlib
import io

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from podtrain import storage
from podtrain.config.schema import Config
from podtrain.data import pairs
from podtrain.data.loader import BatchReader, in_order
from podtrain.errors import CheckpointError, DataError
from podtrain.program.tasks import padded, row_readers
from podtrain.sharding import Parallelism, batch_sharding, sharded_jit, shardings_of

REFERENCE_FILE = "dpo_reference.npz"


def references(rows: jax.Array) -> jax.Array:
    """The reference's log-probabilities (batch, 2) that rows (batch, 2, 3, seq + 1) carry as float32 bits."""
    return jax.lax.bitcast_convert_type(rows[:, :, pairs.REFERENCE, 0], jnp.float32)


def dpo_terms(policy: jax.Array, rows: jax.Array, beta: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per pair (batch,): DPO's loss, the reward margin, and whether it is a real pair (not padding),
    of the model's summed reply log-probabilities `policy` (batch, 2: chosen, rejected)."""
    rewards = beta * (policy - references(rows))
    margin = rewards[:, pairs.CHOSEN] - rewards[:, pairs.REJECTED]
    real = rows[:, pairs.CHOSEN, pairs.TRAINED].any(-1)
    return -jax.nn.log_sigmoid(margin), margin, real


def _pooled(x: jax.Array, real: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sum, count) over the real pairs, which the step and the evaluation pool into a mean."""
    return jnp.where(real, x.astype(jnp.float32), 0.0).sum(), real.sum().astype(jnp.float32)


def dpo_loss(model, carry, rows: jax.Array, key, log_probs, beta: float):
    """The mean DPO loss of preference pairs (batch, 2, 3, seq + 1), plus the model's own auxiliary
    loss (an MoE's balancing terms, whose parts are logged). `log_probs(model, rows)` gives the
    replies' summed log-probabilities and the auxiliary terms."""
    policy, aux = log_probs(model, rows)
    losses, margin, real = dpo_terms(policy, rows, beta)
    loss = jnp.where(real, losses, 0.0).sum() / jnp.maximum(real.sum(), 1)
    metrics = {k: v for k, v in aux.items() if k != "loss"}
    metrics |= {"dpo_margin": _pooled(margin, real), "dpo_accuracy": _pooled(margin > 0, real)}
    return loss + aux.get("loss", 0.0), (carry, metrics)


def dpo_validation(model, rows: jax.Array, log_probs, beta: float) -> dict:
    """The held-out pairs' DPO loss, margin, accuracy and share with the chosen reply likelier."""
    policy = log_probs(model, rows)[0]
    losses, margin, real = dpo_terms(policy, rows, beta)
    return {
        "val_loss": _pooled(losses, real),
        "val_dpo_margin": _pooled(margin, real),
        "val_dpo_accuracy": _pooled(margin > 0, real),
        "val_chosen_likelier": _pooled(policy[:, pairs.CHOSEN] > policy[:, pairs.REJECTED], real),
    }


class Preferences:
    """A DPO run's pairs: their train and held-out readers, and the reference's log-probabilities,
    written into the rows by `start` before the first batch is read."""

    def __init__(self, cfg: Config, mesh, tokenizer, train_batch, log_probs):
        t, data = cfg.train, cfg.data
        self.cfg, self.mesh, self.log_probs = cfg, mesh, log_probs
        self.train, val, self.summary = pairs.pair_rows(data.path, tokenizer, t.seq_len + 1, data.val_fraction)
        if len(self.train) < t.batch_size:
            raise DataError(
                f"data.path={data.path} holds {len(self.train)} train pairs that fit train.seq_len + 1 = "
                f"{t.seq_len + 1} tokens, fewer than train.batch_size={t.batch_size}; use more pairs, a smaller "
                "train.batch_size, or a larger train.seq_len."
            )
        self.summary += f"; an epoch is {len(self.train) // t.batch_size:,} steps"
        # Held out: padded with rows of no trained token to whole batches; `val` is a view, so the
        # references written into it reach the padded rows read.
        held_out = padded(val, t.batch_size)
        self.val = held_out[: len(val)]
        self.batches, self.eval_batches = row_readers(self.train, held_out, train_batch, mesh, cfg)

    def digest(self) -> str:
        """The pairs' tokens and trained marks: what the kept references were computed on."""
        h = hashlib.sha256()
        for rows in (self.train, self.val):
            h.update(np.ascontiguousarray(rows[:, :, : pairs.REFERENCE]).tobytes())
        return h.hexdigest()

    def start(self, fns, params, run_dir, step: int) -> str:
        """Write the reference's log-probabilities into the rows: at step 0 those of `params` (the
        starting weights), kept in RUN_DIR/dpo_reference.npz by process 0; later those kept. Returns
        a line on how the reference itself ranks the pairs."""
        file = storage.path(run_dir) / REFERENCE_FILE
        if step == 0:
            train, val = self._reference(fns, params)
            if jax.process_index() == 0:
                out = io.BytesIO()
                np.savez(out, train=train, val=val, digest=np.array(self.digest()))
                storage.write_bytes(file, out.getvalue())
        else:
            if not file.is_file():
                raise CheckpointError(
                    f"{file} is missing: a DPO run resumed at step {step} needs the reference log-probabilities "
                    "its first step computed from the starting weights, which the trained weights no longer are. "
                    "Restore the file, or train again in a new run_dir."
                )
            kept = np.load(io.BytesIO(file.read_bytes()))
            if str(kept["digest"]) != self.digest():
                raise DataError(
                    f"The preference pairs of data.path={self.cfg.data.path} are not those whose references {file} "
                    "holds (they or the tokenizer changed since step 0); resume with the run's data, or use a new "
                    "run_dir."
                )
            train, val = kept["train"], kept["val"]
        for rows, values in ((self.train, train), (self.val, val)):
            rows[:, :, pairs.REFERENCE, 0] = values.astype(np.float32).view(np.int32)
        likelier = [float(np.mean(v[:, pairs.CHOSEN] > v[:, pairs.REJECTED])) for v in (train, val)]
        return (
            f"the reference finds the chosen reply likelier in {likelier[0]:.1%} of train / {likelier[1]:.1%} of "
            "held-out pairs"
        )

    def _reference(self, fns, params) -> tuple[np.ndarray, np.ndarray]:
        """The replies' summed log-probabilities (pairs, 2) under `params`, of the train and the held-out
        pairs, on the mesh: every process runs the same batches and gets all the values."""
        size = self.cfg.train.batch_size
        rows = padded(np.concatenate([self.train, self.val]), size)
        reader = BatchReader(
            in_order(len(rows), size, len(rows) // size, rows.__getitem__),
            batch_sharding(self.mesh),
            (size, *rows.shape[1:]),
            axis=0,
        )
        run = sharded_jit(
            lambda params, batch: self.log_probs(fns.module(params), batch)[0],
            self.mesh,
            Parallelism.of(self.cfg),
            in_shardings=(shardings_of(fns.abstract_params), batch_sharding(self.mesh)),
            out_shardings=NamedSharding(self.mesh, PartitionSpec()),
        )
        values = np.concatenate([np.asarray(jax.device_get(run(params, reader[i]))) for i in range(len(reader))])
        return values[: len(self.train)], values[len(self.train) : len(self.train) + len(self.val)]
