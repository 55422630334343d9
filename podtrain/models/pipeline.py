"""A stack of layers as a pipeline over the mesh's `stage` axis (GPipe, Huang et al. 2019).

The stack's L layers are cut into S consecutive stages of L/S, one per stage shard (its params
split over `stage` along their `layers` axis), and the batch into M microbatches. For M + S - 1
ticks, every stage runs its layers on the microbatch it holds, all at once (a vmap over stages
that XLA partitions over `stage`), then hands its output on to the next (a roll along the
stage axis: a collective permute). The first stage takes the next microbatch, the last gives
its result; its idle ticks are the bubble, (S - 1) / (M + S - 1) of the time. Autodiff runs the
same schedule backwards. Everything else the layers read per example (positions, segment ids,
RoPE tables) travels with its microbatch.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from podtrain.sharding import constrain, per_stage


def pipelined(run_stage: Callable, state, x, per_example: tuple, per_layer: tuple, stages: int, microbatches: int):
    """run_stage(stage's state, h, per_example, stage's per_layer) -> h over S stages and M microbatches.

    state and per_layer are trees of (layers, ...) arrays; x and per_example of (batch, ...) ones
    (None allowed)."""
    s, m = stages, microbatches

    def cut(a):  # (layers, ...) -> (stages, layers per stage, ...)
        return a.reshape(s, a.shape[0] // s, *a.shape[1:])

    def split(a):  # (batch, ...) -> (microbatches, batch per microbatch, ...)
        return a.reshape(m, a.shape[0] // m, *a.shape[1:])

    def staged(tree):  # pin the leading axis to the stages, the next to the batch
        return jax.tree.map(lambda a: constrain(a, ("layers", "act_batch", *(None,) * (a.ndim - 2))), tree)

    state, per_layer = jax.tree.map(cut, (state, per_layer))
    xs, examples = jax.tree.map(split, (x, per_example))
    buffer = jax.tree.map(lambda a: jnp.zeros((s, *a.shape[1:]), a.dtype), xs)
    outputs = jax.tree.map(jnp.zeros_like, xs)
    run = jax.vmap(run_stage, spmd_axis_name="stage")

    def tick(carry, i):
        buffer, outputs = carry
        taken = jnp.minimum(i, m - 1)  # after the last, a copy of it that never reaches the end
        buffer = staged(jax.tree.map(lambda b, a: b.at[0].set(a[taken]), buffer, xs))
        held = jnp.clip(i - jnp.arange(s), 0, m - 1)  # the microbatch in each stage
        with per_stage():
            out = run(state, buffer, jax.tree.map(lambda a: a[held], examples), per_layer)
        out = staged(out)
        done = i - (s - 1)  # the microbatch leaving the last stage, if any yet
        slot = jnp.maximum(done, 0)
        outputs = jax.tree.map(lambda o, y: o.at[slot].set(jnp.where(done >= 0, y[-1], o[slot])), outputs, out)
        return (jax.tree.map(lambda y: jnp.roll(y, 1, axis=0), out), outputs), None

    (_, outputs), _ = jax.lax.scan(tick, (buffer, outputs), jnp.arange(m + s - 1))
    return jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), outputs)
