"""Attention over a sequence split across devices (context parallelism, mesh axis `context`):
each device keeps its queries and sees every key, by one of two strategies.

- all_gather: the keys and values of every shard are gathered, then attended to at once (MaxText's
  default): one all-gather of K and V per layer forward, a reduce-scatter of their gradients back.
- ring: the shards' keys and values go round a ring, one step per shard, each step folded into an
  online softmax (running max, sum and output): no device ever holds more than one other shard's
  K and V; each step is recomputed in the backward pass, whose ring runs the other way.

The tokens arrive in any order (the language task interleaves them so that causal work is even
over the shards): what a query sees is decided by the tokens' positions and segment ids, never
by their place in the array.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from podtrain.models.attention.xla import grouped_attention, scores, visible
from podtrain.models.layers import HEADS, SEGMENTS
from podtrain.sharding import gather, pass_on, per_shard, shards_along


def context_attention(
    q_BTNH, k_BTKH, v_BTKH, positions, segments, window, *, strategy: str, causal: bool, scale: float, softcap: float
) -> jax.Array:
    """softmax(q k^T * scale) v of a sequence sharded over `act_seq`: `positions` (batch, seq) decide
    causality and the sliding `window` (a scalar or None), `segments` (batch, seq, or None) keep
    packed documents apart. Run per shard with the batch, sequence and heads split as the rules say."""
    packed, windowed = segments is not None, window is not None

    def local(q, k, v, positions, *rest):
        segments, window = (rest[0] if packed else None), (rest[-1] if windowed else None)
        if strategy == "ring":
            return _ring(q, k, v, positions, segments, window, causal, scale, softcap)
        k, v, k_positions = (gather(x, "act_seq", axis=1) for x in (k, v, positions))
        pair = None if segments is None else (segments, gather(segments, "act_seq", axis=1))
        return grouped_attention(
            q, k, v, causal, scale, softcap, segments=pair, window=window, q_index=positions, k_index=k_positions
        )

    window = [jnp.asarray(window, jnp.int32)] if windowed else []
    arrays = [q_BTNH, k_BTKH, v_BTKH, positions] + ([segments] if packed else []) + window
    names = [HEADS, HEADS, HEADS, SEGMENTS] + ([SEGMENTS] if packed else []) + ([()] if windowed else [])
    return per_shard(local, tuple(names), HEADS)(*arrays)


def _ring(q_BTNH, k_BSKH, v_BSKH, positions, segments, window, causal, scale, softcap):
    """This shard's queries against every shard's keys, which pass round the ring: after step r
    this shard has folded in the keys of the shard r places before it."""
    b, t, n, h = q_BTNH.shape
    kv = k_BSKH.shape[2]
    q = q_BTNH.reshape(b, t, kv, n // kv, h) * jnp.asarray(scale, q_BTNH.dtype)

    @jax.checkpoint  # the backward recomputes a step's scores: one block of them alive at a time
    def fold(state, block):
        top, total, out = state  # (B, K, T, G, 1) running max and sum; (B, T, K, G, H) unnormalised output
        k, v, k_positions, k_segments = block
        sight = ((positions, k_positions), None if segments is None else (segments, k_segments), window)
        ok = visible(sight, 0, t, k.shape[1], causal)
        logits = jnp.where(ok, scores(q, k, softcap), -1e30)
        new_top = jnp.maximum(top, logits.max(axis=-1, keepdims=True))
        probs = jnp.where(ok, jnp.exp(logits - new_top), 0.0)
        kept = jnp.exp(top - new_top)
        total = total * kept + probs.sum(axis=-1, keepdims=True)
        out = out * kept.transpose(0, 2, 1, 3, 4) + jnp.einsum(
            "bktgs,bskh->btkgh", probs.astype(v.dtype), v, preferred_element_type=jnp.float32
        )
        return new_top, total, out

    state = (
        jnp.full((b, kv, t, n // kv, 1), -1e30, jnp.float32),
        jnp.zeros((b, kv, t, n // kv, 1), jnp.float32),
        jnp.zeros((b, t, kv, n // kv, h), jnp.float32),
    )
    block = (k_BSKH, v_BSKH, positions, segments)
    shards = shards_along("act_seq")
    for step in range(shards):
        state = fold(state, block)
        if step < shards - 1:
            block = pass_on(block, "act_seq")
    top, total, out = state
    return (out / total.transpose(0, 2, 1, 3, 4)).astype(q_BTNH.dtype).reshape(b, t, n, h)
