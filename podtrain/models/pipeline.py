"""A stack of layers as a pipeline over the mesh's `stage` axis: GPipe (Huang et al. 2019) and the
circular schedule (Narayanan et al. 2021's interleaved stages, MaxText's `num_pipeline_repeats`).

The stack's L layers are cut into S x R pieces of L/(S R) and piece j is run by stage j mod S:
with R = 1 (GPipe) each stage holds consecutive layers, with R > 1 (circular) stage s holds
pieces s, s + S, ... The batch is cut into M >= S microbatches. Work item k = r M + m is
microbatch m on its lap r round the stages. At tick t stage s runs item t - s on piece r S + s,
all stages at once (a vmap over stages that XLA partitions over `stage`), then hands its output
on to the next (a roll along the stage axis: a collective permute). The first stage takes a fresh
microbatch on lap 0 and the last stage's output of the previous lap after (it was ready M - S + 1
ticks before); the last stage's output of lap R - 1 is the result. R M + S - 1 ticks, of which
each stage idles S - 1: the bubble, (S - 1) / (R M + S - 1). Autodiff runs the same schedule
backwards. Everything the layers read per example (positions, segment ids, RoPE tables) travels
with its microbatch; what is the same for every example (a RoPE table of shared positions) goes
whole to every stage. A layer's report (an MoE layer's routing statistics, means over its batch's
tokens) is summed over the M microbatches it ran and divided by M: their mean, which is the whole
batch's, the microbatches being of one size.

`run_stack` is the one place a stack becomes a pipeline: every stack runs through it, and
decoding, never cut into microbatches, runs as it is.

The params keep one layout, consecutive layers per stage shard, whatever the schedule (so a
checkpoint restores onto any mesh); the circular schedule regroups them into its pieces once per
step, an all-to-all along `stage` of (R - 1) / R of each stage's weights, and its gradients back.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from podtrain.errors import ConfigError
from podtrain.sharding import Parallelism, constrain, per_stage, stages


def run_stack(run: Callable, state, x, args: tuple, per_layer: tuple, decode: bool = False, unbatched=()):
    """The one place a layer stack becomes a pipeline: `run(state, x, args, per_layer)` -> (x,
    reports), as it is, or over the mesh's `stage` axis where it has one, each of `args` cut into
    microbatches but those at the indices `unbatched`, whole for every microbatch. Decoding (a
    prompt, then a token at a time) runs as it is on purpose: a batch of 1 has nothing to cut into
    microbatches. A batch the microbatches do not divide is refused, never run another way."""
    n, pipeline = stages()
    if n == 1 or decode:
        return run(state, x, args, per_layer)
    batch = jax.tree.leaves(x)[0].shape[0]
    if batch % pipeline.microbatches:
        raise ConfigError(
            f"pipeline.microbatches={pipeline.microbatches} does not divide a batch of {batch} sequences through the "
            "pipelined layers; make train.batch_size / train.grad_accum a multiple of pipeline.microbatches."
        )
    per_example = tuple(None if i in unbatched else a for i, a in enumerate(args))

    def with_whole(state, h, examples, per_layer):  # each stage's microbatch of args, the whole ones put back
        return run(state, h, tuple(args[i] if i in unbatched else a for i, a in enumerate(examples)), per_layer)

    return pipelined(with_whole, state, nnx.get_partition_spec(state), x, per_example, per_layer, n, pipeline)


def pipelined(
    run_stage: Callable, state, names, x, per_example: tuple, per_layer: tuple, stages: int, pipeline: Parallelism
):
    """run_stage(stage's state, h, per_example, stage's per_layer) -> (h, reports (layers, ...)) over
    `stages` as `pipeline` says; returns (h, reports (layers, ...)), each layer's report the mean of
    its microbatches' (a report is a mean over its batch's tokens, as an MoE's routing statistics are).

    state and per_layer are trees of (layers, ...) arrays, `names` the logical axis names of each of
    state's leaves (a tree of tuples like it); x and per_example are trees of (batch, ...) arrays
    (None allowed)."""
    s, m, r = stages, pipeline.microbatches, pipeline.repeats

    def cut(a):  # (layers, ...) -> (stages, repeats, layers per piece, ...): piece j = repeat x stages + stage
        return a.reshape(r, s, a.shape[0] // (s * r), *a.shape[1:]).swapaxes(0, 1)

    def split(a):  # (batch, ...) -> (microbatches, batch per microbatch, ...)
        return a.reshape(m, a.shape[0] // m, *a.shape[1:])

    # Each stage's pieces on its stage shard, each weight otherwise split as the params are.
    state = jax.tree.map(lambda a, n: constrain(cut(a), ("layers", None, None, *n[1:])), state, names)
    xs, examples = jax.tree.map(split, (x, per_example))

    def run_piece(state, lap, h, examples, per_layer):  # one stage: its piece of this lap
        state, per_layer = jax.tree.map(lambda a: a[0] if r == 1 else a[lap], (state, per_layer))
        return run_stage(state, h, examples, per_layer)

    run = jax.vmap(run_piece, spmd_axis_name="stage")
    outputs, reports = _schedule(run, state, xs, examples, jax.tree.map(cut, per_layer), s, m, r)

    def uncut(a):  # cut's inverse, each layer's reports averaged over the microbatches
        return a.swapaxes(0, 1).reshape(-1, *a.shape[3:]) / m

    return jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), outputs), jax.tree.map(uncut, reports)


def _schedule(run, state, xs, examples, per_layer, s: int, m: int, r: int):
    """The ticks of the schedule: (each microbatch's output (microbatches, ...), the stages' reports
    summed over the microbatches (stages, repeats, layers per piece, ...))."""

    def staged(tree):  # pin the leading axis to the stages, the next to the batch
        return jax.tree.map(lambda a: constrain(a, ("layers", "act_batch", *(None,) * (a.ndim - 2))), tree)

    def by_stage(tree):  # pin the leading axis to the stages
        return jax.tree.map(lambda a: constrain(a, ("layers", *(None,) * (a.ndim - 1))), tree)

    buffer = jax.tree.map(lambda a: jnp.zeros((s, *a.shape[1:]), a.dtype), xs)
    outputs = jax.tree.map(jnp.zeros_like, xs)  # the last stage's latest output of each microbatch
    with per_stage():
        shapes = jax.eval_shape(
            run, state, jnp.zeros(s, jnp.int32), buffer, jax.tree.map(lambda a: a[:s], examples), per_layer
        )[1]
    totals = jax.tree.map(lambda a: jnp.zeros((s, r, *a.shape[1:]), a.dtype), shapes)

    def tick(carry, t):
        buffer, outputs, totals = carry
        item = t - jnp.arange(s)  # each stage's work item; outside [0, R M) a placeholder never kept
        kept = (item >= 0) & (item < r * m)
        item = jnp.clip(item, 0, r * m - 1)
        micro, lap = item % m, item // m
        first = jax.tree.map(lambda a, o: jnp.where(lap[0] == 0, a[micro[0]], o[micro[0]]), xs, outputs)
        buffer = staged(jax.tree.map(lambda b, a: b.at[0].set(a), buffer, first))
        with per_stage():
            out, reports = run(state, lap, buffer, jax.tree.map(lambda a: a[micro], examples), per_layer)
        out = staged(out)
        last = micro[-1]
        outputs = jax.tree.map(lambda o, y: o.at[last].set(jnp.where(kept[-1], y[-1], o[last])), outputs, out)
        counted = kept[:, None] & (lap[:, None] == jnp.arange(r)[None])  # (stages, repeats): the lap each stage ran
        totals = by_stage(jax.tree.map(lambda a, y: a + _where(counted, y[:, None], 0), totals, reports))
        return (jax.tree.map(lambda y: jnp.roll(y, 1, axis=0), out), outputs, totals), None

    (_, outputs, totals), _ = jax.lax.scan(tick, (buffer, outputs, totals), jnp.arange(r * m + s - 1))
    return outputs, totals


def _where(mask, x, other):
    """jnp.where with mask's leading axes broadcast over x's trailing ones."""
    return jnp.where(mask.reshape(*mask.shape, *(1,) * (x.ndim - mask.ndim)), x, other)
