"""Attention over a sequence split across devices (context parallelism, mesh axis `context`):
each device keeps its queries and sees every key, by one of the strategies of `context.strategy`
(`STRATEGIES`).

- all_gather: the keys and values of every shard are gathered, then attended to at once (MaxText's
  default): one all-gather of K and V per layer forward, a reduce-scatter of their gradients back.
- ring: the shards' keys and values go round a ring, one step per shard, each step folded into an
  online softmax (running max, sum and output) a block of queries at a time: no device ever holds
  more than one other shard's K and V, nor more than a block's scores; the backward pass
  recomputes them block by block, and its ring runs the other way.

Causal tokens arrive in balanced order (`sharding.balanced_order`, which the language task applies
when it builds a batch): the ring computes only the pairs of shards' halves that this order can
let through, the same number on every shard. Within those, what a query sees is decided by the
tokens' positions and segment ids, never by their place in the array.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp

from podtrain.models.attention.xla import grouped_attention, scores, visible
from podtrain.models.layers import HEADS, SEGMENTS
from podtrain.sharding import gather, pass_on, per_shard, shard_index, shards_along

# Queries folded into the ring's online softmax at a time: a block's float32 scores against half
# a shard's keys stay small (512 MiB per sequence at 131,072 tokens over 8 shards, 32 heads).
RING_BLOCK = 512


def context_attention(
    q_BTNH, k_BTKH, v_BTKH, positions, segments, window, *, strategy: str, causal: bool, scale: float, softcap: float
) -> jax.Array:
    """softmax(q k^T * scale) v of a sequence sharded over `act_seq`: `positions` (batch, seq) decide
    causality and the sliding `window` (a scalar or None), `segments` (batch, seq, or None) keep
    packed documents apart. Run per shard with the batch, sequence and heads split as the rules say."""
    packed, windowed = segments is not None, window is not None

    def local(q, k, v, positions, *rest):
        segments, window = (rest[0] if packed else None), (rest[-1] if windowed else None)
        return STRATEGIES[strategy](q, k, v, positions, segments, window, causal, scale, softcap)

    window = [jnp.asarray(window, jnp.int32)] if windowed else []
    arrays = [q_BTNH, k_BTKH, v_BTKH, positions] + ([segments] if packed else []) + window
    names = [HEADS, HEADS, HEADS, SEGMENTS] + ([SEGMENTS] if packed else []) + ([()] if windowed else [])
    return per_shard(local, tuple(names), HEADS)(*arrays)


def _all_gather(q_BTNH, k_BSKH, v_BSKH, positions, segments, window, causal, scale, softcap):
    """This shard's queries against every shard's keys and values, gathered."""
    k, v, k_positions = (gather(x, "act_seq", axis=1) for x in (k_BSKH, v_BSKH, positions))
    pair = None if segments is None else (segments, gather(segments, "act_seq", axis=1))
    return grouped_attention(
        q_BTNH, k, v, causal, scale, softcap, segments=pair, window=window, q_index=positions, k_index=k_positions
    )


def _ring(q_BTNH, k_BSKH, v_BSKH, positions, segments, window, causal, scale, softcap):
    """This shard's queries against every shard's keys, which pass round the ring: after step r
    this shard (i of c) has folded in the keys of shard j = i - r mod c. Causal tokens are in
    balanced order, shard i holding chunks i and 2c-1-i (its `lo` and `hi` halves), so which
    halves can see which is known without looking: hi queries see every shard's lo keys; from
    its own shard, lo sees lo and hi sees hi (causally); from an earlier shard (j < i) lo sees
    lo, from a later one hi sees hi, and nothing else. A step after the first computes two
    quarters of the pairs, the same on every shard; the second is picked by `where`, not a branch."""
    b, t, n, h = q_BTNH.shape
    kv = k_BSKH.shape[2]
    q = q_BTNH.reshape(b, t, kv, n // kv, h) * jnp.asarray(scale, q_BTNH.dtype)

    def halves(arrays):  # a shard's lo and hi chunks
        return _rows(arrays, 0, t // 2), _rows(arrays, t // 2, t)

    lo, hi = halves((q, positions, segments))
    fold = partial(_fold, window=window, causal=causal, softcap=softcap)
    block = (k_BSKH, v_BSKH, positions, segments)
    (k_lo, k_hi), states = halves(block), (_start(lo[0]), _start(hi[0]))
    if causal:  # this shard's own keys
        states = fold(states[0], lo, k_lo), fold(fold(states[1], hi, k_lo), hi, k_hi)
    else:
        states = fold(states[0], lo, block), fold(states[1], hi, block)

    def other(carry, step):  # the next shard's keys along the ring: from shard j = i - step mod c
        (state_lo, state_hi), block = carry
        block = pass_on(block, "act_seq")
        k_lo, k_hi = halves(block)
        if not causal:
            return ((fold(state_lo, lo, block), fold(state_hi, hi, block)), block), None
        earlier = shard_index("act_seq") >= step  # j < i

        def pick(if_earlier, if_later):
            return jax.tree.map(lambda a, z: jnp.where(earlier, a, z), if_earlier, if_later)

        state_hi = fold(state_hi, hi, k_lo)
        folded = fold(pick(state_lo, state_hi), pick(lo, hi), pick(k_lo, k_hi))
        return ((pick(folded, state_lo), pick(state_hi, folded)), block), None

    (state_lo, state_hi), _ = jax.lax.scan(other, (states, block), jnp.arange(1, shards_along("act_seq")))[0]
    out = jnp.concatenate([o / total[..., None] for _, total, o in (state_lo, state_hi)], axis=1)
    return out.astype(q_BTNH.dtype).reshape(b, t, n, h)


def _rows(arrays, lo: int, hi: int):
    """Sequence rows lo..hi-1 (axis 1) of each array (None stays None)."""
    return jax.tree.map(lambda x: x[:, lo:hi], arrays)


def _start(q_BTKGH):
    """An online softmax before any key: running max and sum (B, T, K, G), unnormalised output (B, T, K, G, H)."""
    b, t, kv, g, h = q_BTKGH.shape
    return (
        jnp.full((b, t, kv, g), -1e30, jnp.float32),
        jnp.zeros((b, t, kv, g), jnp.float32),
        jnp.zeros(q_BTKGH.shape, jnp.float32),
    )


def _fold(state, queries, keys, *, window, causal, softcap):
    """The online softmax `state` of `queries` (q, positions, segments) with `keys` (k, v,
    positions, segments) folded in, RING_BLOCK queries at a time: a block's float32 scores are
    the largest array, and the backward pass recomputes them block by block."""
    rows = queries[0].shape[1]
    size = math.gcd(rows, RING_BLOCK)
    k, v, k_at, k_segments = keys

    @jax.checkpoint
    def one(_, block):
        (top, total, out), (q, q_at, q_segments) = block
        sight = ((q_at, k_at), None if q_segments is None else (q_segments, k_segments), window)
        ok = visible(sight, 0, q.shape[1], k.shape[1], causal)
        logits = jnp.where(ok, scores(q, k, softcap), -1e30)  # (B, K, T, G, S)
        new_top = jnp.maximum(top, logits.max(axis=-1).transpose(0, 2, 1, 3))
        probs = jnp.where(ok, jnp.exp(logits - new_top.transpose(0, 2, 1, 3)[..., None]), 0.0)
        kept = jnp.exp(top - new_top)
        total = total * kept + probs.sum(axis=-1).transpose(0, 2, 1, 3)
        out = out * kept[..., None] + jnp.einsum(
            "bktgs,bskh->btkgh", probs.astype(v.dtype), v, preferred_element_type=jnp.float32
        )
        return None, (new_top, total, out)

    def blocks(x):  # (B, rows, ...) as (rows / size, B, size, ...), and back
        return jnp.moveaxis(x.reshape(x.shape[0], rows // size, size, *x.shape[2:]), 1, 0)

    def whole(x):
        return jnp.moveaxis(x, 0, 1).reshape(x.shape[1], rows, *x.shape[3:])

    if rows == size:  # one block: no loop to compile
        return one(None, (state, queries))[1]
    _, state = jax.lax.scan(one, None, jax.tree.map(blocks, (state, queries)))
    return jax.tree.map(whole, state)


# context.strategy -> how a shard's queries attend to every shard's keys: (q, k, v, positions,
# segments, window, causal, scale, softcap) of this shard -> its output
STRATEGIES = {"all_gather": _all_gather, "ring": _ring}
