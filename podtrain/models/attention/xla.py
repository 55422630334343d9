"""Grouped-query attention in plain XLA operations, with FlashAttention's backward: what a query
sees is given in O(T) (places, segment ids, a window), and causal work is cut into blocks."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

# Causal attention runs in this many blocks of queries, each reading only the keys up to its last
# query: 9/16 of the full score matrix is computed, and each block's scores are small enough to stay
# in cache between the softmax's passes (on 2 CPU cores, 8 blocks take ~0.6x the time of one).
CAUSAL_BLOCKS = 8
MIN_BLOCK = 32  # queries: a smaller block saves nothing worth its compile time


def sees(q_at, k_at, causal: bool, window=None):
    """Whether a query at place q_at sees a key at k_at (numpy or jax arrays that broadcast): a
    key at or before it when `causal` (else any key), within `window` places of it on either
    side it sees (None, 0 or less: no window). Every core asks this rule."""
    ok = k_at <= q_at if causal else (k_at <= q_at) | (k_at > q_at)
    if window is None:
        return ok
    return ok & (((q_at - k_at < window) & (k_at - q_at < window)) | (window <= 0))


def causal_blocks(t: int) -> int:
    """The query blocks of a causal self-attention over t positions: up to CAUSAL_BLOCKS, whole and
    of at least MIN_BLOCK queries each. They compute (blocks + 1) / (2 blocks) of the scores."""
    blocks = CAUSAL_BLOCKS
    while blocks > 1 and (t % blocks or t // blocks < MIN_BLOCK):
        blocks //= 2
    return blocks


def grouped_attention(
    q_BTNH: jax.Array,
    k_BSKH: jax.Array,
    v_BSKH: jax.Array,
    causal: bool = True,
    scale: float | None = None,
    softcap: float = 0.0,
    *,
    segments: tuple[jax.Array, jax.Array] | None = None,
    window: jax.Array | int | None = None,
    q_index: jax.Array | None = None,
    k_index: jax.Array | None = None,
) -> jax.Array:
    """softmax(q k^T * scale) v, scale 1/sqrt(head_dim) unless given, each k/v head read in place
    by its group of query heads (no copies); scores and softmax in float32. What a query sees is
    described in O(T), never as a (T, S) mask: with `causal`, keys at or before its place in the
    sequence (`q_index` (T,) or (batch, T) and `k_index`: places, default 0, 1, ...); within a
    sliding `window` of the latest places, itself included (0: all); and with `segments` (q's
    (batch, T), k's (batch, S)) only keys of its own segment (packed documents). A `softcap` c
    bounds the scores to (-c, c) as c tanh(s / c), before the mask (Gemma 2). v's heads may be wider
    or narrower than q's and k's (latent attention's): the output takes v's."""
    b, t, n, h = q_BTNH.shape
    s, kv = k_BSKH.shape[1:3]
    # Scaled before the product: T x H, not T x S, multiplies.
    q = q_BTNH.reshape(b, t, kv, n // kv, h) * jnp.asarray(scale or h**-0.5, q_BTNH.dtype)
    blocks = causal_blocks(t) if causal and t == s and q_index is None and k_index is None else 1
    places = (jnp.arange(t) if q_index is None else q_index, jnp.arange(s) if k_index is None else k_index)
    return _attend(q, k_BSKH, v_BSKH, (places, segments, window), blocks, softcap, causal).reshape(b, t, n, -1)


def visible(sight, lo: int, hi: int, end: int, causal: bool) -> jax.Array:
    """(batch or 1, 1, hi - lo, 1, end): True where queries lo..hi-1 may attend to keys 0..end-1,
    by the places, segments and window of `sight` (grouped_attention's)."""
    (q_index, k_index), segments, window = sight
    q_at, k_at = jnp.atleast_2d(q_index)[:, lo:hi, None], jnp.atleast_2d(k_index)[:, None, :end]
    ok = sees(q_at, k_at, causal, window)
    if segments is not None:
        ok = ok & (segments[0][:, lo:hi, None] == segments[1][:, None, :end])
    return ok[:, None, :, None, :]


def _spans(t: int, s: int, blocks: int) -> list[tuple[int, int, int]]:
    """(first query, end of queries, end of keys) of each block; a causal block reads no key after its last query."""
    size = t // blocks
    return [(i * size, (i + 1) * size, (i + 1) * size if blocks > 1 else s) for i in range(blocks)]


def scores(q_BTKGH, k_BSKH, softcap: float) -> jax.Array:
    """(B, K, T, G, S) float32 scores, soft-capped when `softcap` is set."""
    scores = jnp.einsum("btkgh,bskh->bktgs", q_BTKGH, k_BSKH, preferred_element_type=jnp.float32)
    return softcap * jnp.tanh(scores / softcap) if softcap else scores


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _attend(q_BTKGH, k_BSKH, v_BSKH, sight, blocks, softcap, causal):
    return _attend_fwd(q_BTKGH, k_BSKH, v_BSKH, sight, blocks, softcap, causal)[0]


def _attend_fwd(q_BTKGH, k_BSKH, v_BSKH, sight, blocks, softcap, causal):
    outs, probs = [], []
    for lo, hi, end in _spans(q_BTKGH.shape[1], k_BSKH.shape[1], blocks):
        # Added, not selected: a masked score's probability is 0, so the backward needs no mask.
        bias = jnp.where(visible(sight, lo, hi, end, causal), 0.0, -1e30).astype(jnp.float32)
        probs.append(jax.nn.softmax(scores(q_BTKGH[:, lo:hi], k_BSKH[:, :end], softcap) + bias, axis=-1))
        outs.append(jnp.einsum("bktgs,bskh->btkgh", probs[-1].astype(v_BSKH.dtype), v_BSKH[:, :end]))
    out = jnp.concatenate(outs, axis=1)
    return out, (q_BTKGH, k_BSKH, v_BSKH, probs, out)


def _attend_bwd(blocks, softcap, causal, residuals, d_out):
    """FlashAttention's backward, block by block: the softmax's row term sum_s dP P is sum_h dO O, a
    reduction over the head dimension instead of the keys. A masked score has P = 0: no gradient.
    Through a soft-cap, the capped score c tanh(s / c) is recomputed: its derivative is 1 - tanh²."""
    q, k, v, probs, out = residuals
    row = jnp.einsum("btkgh,btkgh->bktg", d_out.astype(jnp.float32), out.astype(jnp.float32))
    dq, dk, dv = [], jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
    for (lo, hi, end), p in zip(_spans(q.shape[1], k.shape[1], blocks), probs):
        d_block = d_out[:, lo:hi]
        dv = dv.at[:, :end].add(
            jnp.einsum("bktgs,btkgh->bskh", p.astype(v.dtype), d_block, preferred_element_type=jnp.float32)
        )
        d_probs = jnp.einsum("btkgh,bskh->bktgs", d_block, v[:, :end], preferred_element_type=jnp.float32)
        d_scores = p * (d_probs - row[:, :, lo:hi, :, None])
        if softcap:
            d_scores = d_scores * (1 - jnp.square(scores(q[:, lo:hi], k[:, :end], softcap) / softcap))
        d_scores = d_scores.astype(q.dtype)
        dq.append(jnp.einsum("bktgs,bskh->btkgh", d_scores, k[:, :end]))
        dk = dk.at[:, :end].add(
            jnp.einsum("bktgs,btkgh->bskh", d_scores, q[:, lo:hi], preferred_element_type=jnp.float32)
        )
    return jnp.concatenate(dq, axis=1), dk.astype(k.dtype), dv.astype(v.dtype), None


_attend.defvjp(_attend_fwd, _attend_bwd)
