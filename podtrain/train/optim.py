"""AdamW with linear warmup, cosine decay and global-norm clipping."""

from __future__ import annotations

import optax

from podtrain.config import TrainConfig


def schedule(t: TrainConfig) -> optax.Schedule:
    warmup = min(t.warmup_steps, t.steps - 1)
    return optax.warmup_cosine_decay_schedule(0.0, t.lr, warmup, t.steps, t.lr * t.min_lr_ratio)


def optimizer(t: TrainConfig, decay_mask) -> optax.GradientTransformation:
    """decay_mask: a tree like the params, True where weight decay applies (matrices, not norms)."""
    return optax.chain(
        optax.clip_by_global_norm(t.grad_clip),
        optax.adamw(schedule(t), b1=t.beta1, b2=t.beta2, weight_decay=t.weight_decay, mask=decay_mask),
    )
