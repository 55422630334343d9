"""The optimizers, by `train.optimizer` (`OPTIMIZERS`): AdamW or AdamATan2, with linear warmup,
cosine decay and global-norm clipping, and the references' sign-SGD for HRM/TRM's puzzle embedding.

AdamATan2 (Everett et al. 2024, as HRM and TRM train with it, in the `adam-atan2` package's form
with a = b = 1): Adam whose step is atan2(m_hat, sqrt(v_hat)) instead of m_hat / (sqrt(v_hat) + eps),
bounded by pi/2 and free of epsilon; weight decay decoupled as in AdamW.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from podtrain.config.schema import TrainConfig
from podtrain.errors import ConfigError

PUZZLE_EMBEDDING = "puzzle_emb"  # the top-level parameter sign-SGD trains when train.puzzle_emb_lr > 0


def schedule(t: TrainConfig, peak: float | None = None) -> optax.Schedule:
    """The learning rate of optimizer step s (from 0): linear warmup that already trains at step 0
    (peak / warmup_steps) and reaches the peak (train.lr unless given) at step warmup_steps - 1,
    then cosine decay to peak x min_lr_ratio at the last step. A warmup as long as the run only
    ramps up (see warmup_note)."""
    peak = t.lr if peak is None else peak
    if t.warmup_steps >= t.steps:
        ramp = optax.linear_schedule(0.0, peak, t.warmup_steps)
    else:
        ramp = optax.warmup_cosine_decay_schedule(0.0, peak, t.warmup_steps, t.steps, peak * t.min_lr_ratio)
    return lambda step: ramp(step + 1)


def warmup_note(t: TrainConfig) -> str | None:
    """What to tell a user whose warmup does not end before the run does."""
    if t.warmup_steps < t.steps:
        return None
    return (
        f"train.warmup_steps={t.warmup_steps} is not shorter than train.steps={t.steps}: the learning "
        f"rate ramps up for the whole run, reaching {t.steps / t.warmup_steps:.0%} of train.lr={t.lr:g} "
        "at the last step, with no decay."
    )


def clipping(t: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping to train.grad_clip; 0 turns it off."""
    return optax.clip_by_global_norm(t.grad_clip) if t.grad_clip > 0 else optax.identity()


def scale_by_adam_atan2(b1: float, b2: float) -> optax.GradientTransformation:
    """Adam's bias-corrected moments, combined as atan2(m_hat, sqrt(v_hat))."""

    def init(params):
        mu, nu = (jax.tree.map(jnp.zeros_like, params) for _ in range(2))  # own buffers: the step donates both
        return optax.ScaleByAdamState(jnp.zeros([], jnp.int32), mu, nu)

    def update(grads, state, params=None):
        mu = optax.tree.update_moment(grads, state.mu, b1, 1)
        nu = optax.tree.update_moment_per_elem_norm(grads, state.nu, b2, 2)
        count = optax.safe_increment(state.count)
        mu_hat, nu_hat = optax.tree.bias_correction(mu, b1, count), optax.tree.bias_correction(nu, b2, count)
        return jax.tree.map(lambda m, v: jnp.arctan2(m, jnp.sqrt(v)), mu_hat, nu_hat), optax.ScaleByAdamState(
            count, mu, nu
        )

    return optax.GradientTransformation(init, update)


class SignSgdState(NamedTuple):
    count: jax.Array


def sign_sgd_rows(lr: optax.Schedule, weight_decay: float) -> optax.GradientTransformation:
    """The references' sparse embedding update: each row the step's gradient reaches (the puzzles of
    the batch) moves by -lr (sign(g) + weight_decay x p), decay decoupled as in AdamW; the other rows
    stay as they are. A row counts as reached where its gradient is not all zero."""

    def update(grads, state, params):
        rate = lr(state.count)

        def row(g, p):
            reached = jnp.any(g != 0, axis=-1, keepdims=True)
            return jnp.where(reached, -rate * (jnp.sign(g) + weight_decay * p), 0).astype(p.dtype)

        return jax.tree.map(row, grads, params), SignSgdState(optax.safe_increment(state.count))

    return optax.GradientTransformation(lambda _: SignSgdState(jnp.zeros([], jnp.int32)), update)


def adamw(t: TrainConfig, decay_mask) -> optax.GradientTransformation:
    return optax.adamw(schedule(t), b1=t.beta1, b2=t.beta2, weight_decay=t.weight_decay, mask=decay_mask)


def adam_atan2(t: TrainConfig, decay_mask) -> optax.GradientTransformation:
    return optax.chain(
        scale_by_adam_atan2(t.beta1, t.beta2),
        optax.add_decayed_weights(t.weight_decay, decay_mask),
        optax.scale_by_learning_rate(schedule(t)),
    )


# train.optimizer -> its builder: (the train keys, the decay mask) -> the optimizer of the params
# (bar a puzzle embedding that sign-SGD trains), on `schedule`
OPTIMIZERS = {"adamw": adamw, "adam_atan2": adam_atan2}


def main_optimizer(t: TrainConfig, decay_mask) -> optax.GradientTransformation:
    return OPTIMIZERS[t.optimizer](t, decay_mask)


def optimizer(t: TrainConfig, decay_mask) -> optax.GradientTransformation:
    """decay_mask: a tree like the params, True where weight decay applies (matrices, not norms).
    With train.puzzle_emb_lr > 0 the puzzle embedding is trained by sign-SGD on the same schedule
    at that peak rate, and the main optimizer trains the rest."""
    main = main_optimizer(t, decay_mask)
    if t.puzzle_emb_lr > 0:
        if PUZZLE_EMBEDDING not in decay_mask:
            raise ConfigError(
                "train.puzzle_emb_lr trains the puzzle embedding of HRM and TRM, and this model has none; "
                "remove it (or set it to 0)."
            )
        labels = {
            k: jax.tree.map(lambda _, k=k: "embedding" if k == PUZZLE_EMBEDDING else "main", v)
            for k, v in decay_mask.items()
        }
        embedding = sign_sgd_rows(schedule(t, t.puzzle_emb_lr), t.puzzle_emb_weight_decay)
        main = optax.multi_transform({"main": main, "embedding": embedding}, labels)
    return optax.chain(clipping(t), main)
