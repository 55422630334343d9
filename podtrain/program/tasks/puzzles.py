"""Deep supervision with adaptive computation time (ACT): how HRM and TRM train on puzzles.

One optimizer step is one supervision segment for every slot of the batch (the references'
ACTLossHead around their ACT wrapper). The train state's `carry` keeps, per slot, the model's
latents (z_H, z_L), the segments run so far, whether the slot halted, and its puzzle. At each step
a halted slot takes its row of this step's batch as a new puzzle and restarts from the initial
latents; the other slots go on with their own puzzle from where the last segment left them (the
carry is detached). Batch s is read at step s whatever halts, so a resumed run reads the same
data, and the carry is checkpointed with the weights.

Loss of a segment: stablemax cross entropy over the cells (mean per puzzle)
+ 0.5 * BCE(q_halt, "the puzzle is exactly right"); with no_ACT_continue=false (HRM) also
+ 0.5 * BCE(q_continue, sigmoid of the next segment's larger Q logit), that next segment run on
the same weights without gradient.
Halting, in training only: at halt_max_steps, or when q_halt > 0 (TRM) / q_halt > q_continue
(HRM), but with probability halt_exploration_prob not before a step drawn from [2, halt_max_steps].
Train metrics (cell and exact accuracy, ACT steps) are over the slots that halted at that step
(null when none did).

Evaluation runs all halt_max_steps segments on each test puzzle, as the references do, and
reports the last segment's loss, cell and exact accuracy, and act_steps: the segment at which
the halting rule would first have stopped (halt_max_steps if never). `score_puzzles` scores each
puzzle after several segments in one pass, for `podtrain eval`.

Departure: stablemax runs in float32 (the references use float64, which JAX only has globally).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from podtrain.config.schema import Config
from podtrain.data import sudoku
from podtrain.errors import ConfigError, DataError
from podtrain.program.tasks import Task, row_readers
from podtrain.sharding import batch_sharding, shardings_of

CELLS = 81
ROW = 1 + 2 * CELLS  # a puzzle's row: its id, input cells, label cells (sudoku.SudokuSet.rows)


def split(rows: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Rows of sudoku.SudokuSet.rows() -> (puzzle ids, input tokens, label tokens)."""
    return rows[..., 0], rows[..., 1 : 1 + CELLS], rows[..., 1 + CELLS :]


def stablemax_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """-log of s(x_label) / sum s(x), s(x) = x + 1 for x >= 0 and 1 / (1 - x) below: a softmax
    whose tails grow linearly, not exponentially (HRM's loss)."""
    x = logits.astype(jnp.float32)
    s = jnp.where(x >= 0, x + 1, 1 / (1 - jnp.minimum(x, 0)))  # min keeps the unused branch's gradient finite
    log_p = jnp.log(s) - jnp.log(s.sum(-1, keepdims=True))
    return -jnp.take_along_axis(log_p, labels[..., None], axis=-1)[..., 0]


def _halts(q: jax.Array, no_continue: bool) -> jax.Array:
    return q[:, 0] > 0 if no_continue else q[:, 0] > q[:, 1]


def _sum_where(x: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sum of x over the mask, its size): the train step pools these over microbatches."""
    return jnp.where(mask, x, 0).sum().astype(jnp.float32), mask.sum()


def act_loss(model, carry: dict, rows: jax.Array, key: jax.Array):
    """One supervision segment for every slot: (loss, (carry, metrics)). A halted slot takes its
    row of `rows` as a new puzzle from the initial latents; the others go on with their own."""
    r = model.cfg
    new = carry["halted"]
    data = jnp.where(new[:, None], rows, carry["data"])
    z = tuple(
        jnp.where(new[:, None, None], z0, z)
        for z0, z in zip(model.initial_carry(len(rows)), (carry["z_h"], carry["z_l"]))
    )
    steps = jnp.where(new, 0, carry["steps"]) + 1
    ids, inputs, labels = split(data)
    z, logits, q = model(z, inputs, ids)

    correct = jnp.argmax(logits, -1) == labels
    exact = correct.all(-1)
    lm_loss = stablemax_cross_entropy(logits, labels).mean()
    q_halt_loss = optax.sigmoid_binary_cross_entropy(q[:, 0], exact.astype(jnp.float32)).mean()
    losses = {"lm_loss": lm_loss, "q_halt_loss": q_halt_loss}
    last = steps >= r.halt_max_steps
    if not r.no_ACT_continue:
        next_q = jax.lax.stop_gradient(model(z, inputs, ids)[2])
        target = jax.nn.sigmoid(jnp.where(last, next_q[:, 0], next_q.max(-1)))
        losses["q_continue_loss"] = optax.sigmoid_binary_cross_entropy(q[:, 1], target).mean()

    explore, draw = jax.random.split(key)
    min_steps = jnp.where(
        jax.random.bernoulli(explore, r.halt_exploration_prob, steps.shape),
        jax.random.randint(draw, steps.shape, 2, r.halt_max_steps + 1),
        0,
    )
    halted = last | (_halts(q, r.no_ACT_continue) & (steps >= min_steps))
    metrics = {
        **losses,
        "cell_accuracy": _sum_where(correct.mean(-1), halted),
        "exact_accuracy": _sum_where(exact, halted),
        "act_steps": _sum_where(steps, halted),
        "halted": halted.mean(),
    }
    loss = lm_loss + 0.5 * (q_halt_loss + losses.get("q_continue_loss", 0.0))
    return loss, ({"z_h": z[0], "z_l": z[1], "steps": steps, "halted": halted, "data": data}, metrics)


def score_puzzles(model, rows: jax.Array, at: tuple[int, ...] = ()) -> dict:
    """Segments 1 to max(at) (default: halt_max_steps) on each puzzle of `rows`, scored after each
    segment H of `at` as if it were the last: {"loss", "cell_accuracy", "exact_accuracy",
    "act_steps"}, each (len(at), puzzles). act_steps at H is the segment at which the halting rule
    would first have stopped the puzzle with halt_max_steps=H (H if never)."""
    r = model.cfg
    at = at or (r.halt_max_steps,)
    ids, inputs, labels = split(rows)

    def segment(state, i):
        z, halted_at = state
        z, logits, q = model(z, inputs, ids)
        halted_at = jnp.where((halted_at == 0) & _halts(q, r.no_ACT_continue), i, halted_at)
        correct = jnp.argmax(logits, -1) == labels
        scores_B = {
            "loss": stablemax_cross_entropy(logits, labels).mean(-1),
            "cell_accuracy": correct.mean(-1),
            "exact_accuracy": correct.all(-1).astype(jnp.float32),
        }
        return (z, halted_at), scores_B

    start = (model.initial_carry(len(rows)), jnp.zeros(len(rows), jnp.int32))
    (_, halted_at), scores_SxB = jax.lax.scan(segment, start, jnp.arange(1, max(at) + 1))
    last = jnp.array(at)
    scores = {name: score[last - 1] for name, score in scores_SxB.items()}
    never = jnp.where(halted_at == 0, max(at) + 1, halted_at)
    scores["act_steps"] = jnp.minimum(never[None, :], last[:, None]).astype(jnp.float32)
    return scores


def evaluate_puzzles(model, rows: jax.Array) -> dict:
    """score_puzzles' means over `rows` at halt_max_steps, as val_* metrics."""
    return {f"val_{name}": score.mean() for name, score in score_puzzles(model, rows).items()}


class PuzzleTask(Task):
    """Sudoku puzzles for a recursive reasoner, with the ACT carry of every batch slot."""

    name = "puzzles"
    loss_fn = staticmethod(act_loss)
    eval_fn = staticmethod(evaluate_puzzles)

    def __init__(self, cfg: Config, mesh: Mesh, data: bool = True):
        t, m = cfg.train, cfg.model
        if m.max_seq_len != CELLS or m.vocab_size < sudoku.VOCAB:
            raise ConfigError(
                f"Sudoku puzzles are {CELLS} tokens of a vocabulary of {sudoku.VOCAB}; set model.max_seq_len={CELLS} "
                f"and model.vocab_size={sudoku.VOCAB}."
            )
        slots, sharding = (t.grad_accum, t.batch_size // t.grad_accum), batch_sharding(mesh, leading=1)
        self.positions = CELLS

        def per_slot(dtype, *shape):  # laid out like the batch
            return jax.ShapeDtypeStruct((*slots, *shape), dtype, sharding=sharding)

        self.train_batch = per_slot(jnp.int32, ROW)
        latent = per_slot(jnp.dtype(m.compute_dtype), m.max_seq_len + m.puzzle_emb_len, m.d_model)
        self.carry = {
            "z_h": latent,
            "z_l": latent,
            "steps": per_slot(jnp.int32),
            "halted": per_slot(jnp.bool_),
            "data": per_slot(jnp.int32, ROW),
        }
        if not data:
            return
        train_set, test_set = sudoku.load(cfg.data.path, "train"), sudoku.load(cfg.data.path, "test")
        for name, split_set in (("train", train_set), ("test", test_set)):
            if len(split_set.inputs) < t.batch_size:
                raise DataError(
                    f"{cfg.data.path} has {len(split_set.inputs)} {name} puzzles, fewer than "
                    f"train.batch_size={t.batch_size}; build more or lower the batch."
                )
        self.summary = (
            f"{len(train_set.inputs):,} train / {len(test_set.inputs):,} test puzzles (copy-the-givens cell "
            f"accuracy {test_set.copy_baseline():.1%})"
        )
        self.batches, self.eval_batches = row_readers(train_set.rows(), test_set.rows(), self.train_batch, mesh, cfg)

    def initial_carry(self) -> dict:
        """Every slot halted, so step 0 fills all of them from its batch."""
        carry = self.carry
        return jax.jit(
            lambda: {k: jnp.full(s.shape, k == "halted", s.dtype) for k, s in carry.items()},
            out_shardings=shardings_of(carry),
        )()
