"""How token copies reach the experts that chose them under `mesh.expert`, and come back: each
shard holds its own tokens and E / n of the E experts (n shards along `exp`), sends each copy
only to the shard holding its expert, which runs its experts over what arrived, and sends the
outputs back the same way.

`by_ragged` (dropless): copies sorted by expert, each shard's run sent as one ragged block
(`ragged_exchange`, TPU and GPU), landing on the receiver already sorted by its experts; what
moves is the copies themselves, each way. `by_capacity`: a fixed buffer of `capacity` slots per
expert and sequence, filled in queue order (`queue_places`) and swapped whole (`exchange`, any
platform, CPU included); copies past the capacity are dropped, and an empty slot moves too.
Either one calls `run(rows (R, D), sizes (E / n,) or one int for all)` with the rows sorted by
this shard's experts, `sizes` rows each, for the outputs of those rows; rows past their sum are
room, whose outputs are never read.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from podtrain.sharding import exchange, gather, ragged_exchange, shard_index, shards_along


def _before(x: jax.Array, axis: int) -> jax.Array:
    """The exclusive cumulative sum along `axis`: what comes before each entry."""
    return jnp.cumsum(x, axis=axis) - x


def by_ragged(x: jax.Array, chosen: jax.Array, experts: int, run) -> jax.Array:
    """(N, k, D') outputs of each token copy of tokens x (N, D) through its chosen (N, k) of
    `experts` (over all shards), none dropped: the copies sorted by expert (so by shard), sent,
    run and returned. A shard may receive up to n x N x min(k, E / n) copies (all the tokens of
    the group choosing its experts), the room its buffer keeps; balanced, it gets N x k."""
    n_tokens, k = chosen.shape
    flat = chosen.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    rows = x[order // k]  # (N k, D) by expert
    counts = jnp.bincount(flat, length=experts).astype(jnp.int32)
    n = shards_along("exp")
    out = run(rows, counts) if n == 1 else _there_and_back(rows, counts, n, k, run)
    return out[jnp.argsort(order)].reshape(n_tokens, k, -1)


def _there_and_back(rows: jax.Array, counts: jax.Array, n: int, k: int, run) -> jax.Array:
    """`run` over the rows of this shard's experts sent by every shard along `exp`, and each
    output back in the place of its row: rows (M, D) sorted by expert, counts (E,) per expert."""
    local = len(counts) // n
    me = shard_index("exp")
    c = gather(counts[None], "exp", 0).reshape(n, n, local)  # [source, destination, expert] copies
    # Where a source's rows of an expert begin, in its own sorted rows and on the receiver, whose
    # buffer holds its experts' rows in order, each expert's from the sources in order.
    sent_from = _before(c.reshape(n, -1), 1).reshape(n, n, local)
    lands_at = _before(c.sum(0), 1)[None] + _before(c, 0)
    room = n * (len(rows) // k) * min(k, local)
    into = jnp.zeros((room, rows.shape[1]), rows.dtype)
    arrived = ragged_exchange(
        rows, into, sent_from[me].ravel(), c[me].ravel(), lands_at[me].ravel(), c[:, me].ravel(), "exp"
    )
    out = run(arrived, c[:, me].sum(0))
    back = jnp.zeros((len(rows), out.shape[1]), out.dtype)
    return ragged_exchange(
        out, back, lands_at[:, me].ravel(), c[:, me].ravel(), sent_from[:, me].ravel(), c[me].ravel(), "exp"
    )


def queue_places(chosen: jax.Array, experts: int) -> jax.Array:
    """(N, k): each token copy's place in its expert's queue; first choices queue before second
    ones (as GShard and Switch), tokens in order within a choice."""
    flat = chosen.T.reshape(-1)  # every token's first choice, then every token's second...
    onehot = jax.nn.one_hot(flat, experts, dtype=jnp.int32)
    places = ((jnp.cumsum(onehot, axis=0) - 1) * onehot).sum(-1)
    return places.reshape(chosen.shape[::-1]).T


def by_capacity(x: jax.Array, chosen: jax.Array, places: jax.Array, experts: int, capacity: int, run) -> jax.Array:
    """(B, T, k, D') outputs of the copies of tokens x (B, T, D) through their chosen (B, T, k)
    experts, each expert taking the copies of each sequence at `places` (B, T, k) below
    `capacity` into a buffer of (experts, capacity) slots per sequence; the rest give zeros."""
    b, t, k = chosen.shape
    n = shards_along("exp")
    local, d = experts // n, x.shape[-1]
    slot = jnp.where(places < capacity, chosen * capacity + places, experts * capacity)  # dropped: a spare
    sequence = jnp.arange(b)[:, None, None]
    buffer = jnp.zeros((b, experts * capacity + 1, d), x.dtype)
    buffer = buffer.at[sequence, slot].set(jnp.broadcast_to(x[:, :, None, :], (b, t, k, d)))
    # (B, E C, D) -> (shard, its experts, B, C, D): slice i for shard i; what arrives, from shard i
    to = buffer[:, :-1].reshape(b, n, local, capacity, d).transpose(1, 2, 0, 3, 4)
    arrived = exchange(to, "exp").transpose(1, 0, 2, 3, 4)  # (experts, source, B, C, D)
    per_expert = n * b * capacity
    out = run(arrived.reshape(local * per_expert, d), per_expert)  # every expert's slots full
    out = exchange(out.reshape(local, n, b, capacity, -1).transpose(1, 0, 2, 3, 4), "exp")
    out = out.transpose(2, 0, 1, 3, 4).reshape(b, experts * capacity, -1)
    return jnp.concatenate([out, jnp.zeros_like(out[:, :1])], axis=1)[sequence, slot]
