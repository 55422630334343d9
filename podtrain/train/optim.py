"""AdamW with linear warmup, cosine decay and global-norm clipping."""

from __future__ import annotations

import optax

from podtrain.config.schema import TrainConfig


def schedule(t: TrainConfig) -> optax.Schedule:
    """The learning rate of optimizer step s (from 0): linear warmup that already trains at step 0
    (lr / warmup_steps) and reaches lr at step warmup_steps - 1, then cosine decay that reaches
    lr x min_lr_ratio at the last step. A warmup as long as the run only ramps up (see warmup_note)."""
    if t.warmup_steps >= t.steps:
        ramp = optax.linear_schedule(0.0, t.lr, t.warmup_steps)
    else:
        ramp = optax.warmup_cosine_decay_schedule(0.0, t.lr, t.warmup_steps, t.steps, t.lr * t.min_lr_ratio)
    return lambda step: ramp(step + 1)


def warmup_note(t: TrainConfig) -> str | None:
    """What to tell a user whose warmup does not end before the run does."""
    if t.warmup_steps < t.steps:
        return None
    return (
        f"train.warmup_steps={t.warmup_steps} is not shorter than train.steps={t.steps}: the learning rate ramps up for the whole run, "
        f"reaching {t.steps / t.warmup_steps:.0%} of train.lr={t.lr:g} at the last step, with no decay."
    )


def clipping(t: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping to train.grad_clip; 0 turns it off."""
    return optax.clip_by_global_norm(t.grad_clip) if t.grad_clip > 0 else optax.identity()


def optimizer(t: TrainConfig, decay_mask) -> optax.GradientTransformation:
    """decay_mask: a tree like the params, True where weight decay applies (matrices, not norms)."""
    return optax.chain(
        clipping(t),
        optax.adamw(schedule(t), b1=t.beta1, b2=t.beta2, weight_decay=t.weight_decay, mask=decay_mask),
    )
