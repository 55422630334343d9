"""Routed experts, the MLP of a mixture-of-experts layer: a router scores E expert MLPs per token,
the token goes through its k best, and their outputs are summed with the router's weights.

Routing is computed in float32 (`route`): softmax over all experts then top-k (Mixtral,
Qwen3-MoE), or sigmoid scores chosen with a selection-only bias, within the best groups of
experts (DeepSeek-V3). The copies run through grouped matmuls (`grouped_matmul`) on each device's
own tokens (`expert_parallel`): dropless, or with a capacity per expert and sequence past which
copies are dropped and counted. Under `mesh.expert` the experts' weights are split over it and
each copy is sent to the shard holding its expert and back (`exchange.py`). Nothing here sees a
mesh beyond the sharding helpers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from podtrain.models.exchange import by_capacity, by_ragged, queue_places
from podtrain.models.layers import ACT, SwiGLU, param
from podtrain.models.ops import grouped_matmul
from podtrain.sharding import constrain, exchanges_ragged, gather, per_shard, shards_along, sum_over

EXPERT_IN, EXPERT_OUT = ("exp", "embed", "mlp"), ("exp", "mlp", "embed")  # (E, D, F) and (E, F, D)
# What the backward of the experts keeps: the token copies that reached them (so the exchange is not
# run again) and their gate and up projections. The rest (the sort, the gathered weights) it
# computes again.
KEPT = ("expert_tokens", "expert_gate_up")


@dataclass(frozen=True)
class Routing:
    experts: int  # E
    k: int  # experts per token
    score: str = "softmax"  # "softmax" over all experts, or "sigmoid" per expert
    renormalize: bool = True  # the k weights divided by their sum
    groups: int = 1  # experts fall into this many groups...
    topk_groups: int = 1  # ...of which a token chooses within the best this many
    scale: float = 1.0  # the weights times this (DeepSeek-V3's routed_scaling_factor)


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """jax.lax.top_k over the last axis (the lower index first among equals) by k argmaxes: XLA
    splits it over the other axes like any reduction, where its sort-based top_k is gathered whole."""
    values, indices = [], []
    for _ in range(k):
        best = jnp.argmax(x, axis=-1)
        values.append(jnp.take_along_axis(x, best[..., None], axis=-1)[..., 0])
        indices.append(best)
        x = jnp.where(jax.nn.one_hot(best, x.shape[-1], dtype=bool), -jnp.inf, x)
    return jnp.stack(values, -1), jnp.stack(indices, -1)


def route(logits: jax.Array, bias: jax.Array | None, r: Routing) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(weights (..., k) float32, chosen experts (..., k) int32, scores (..., E) float32) of router
    logits (..., E). `bias` (E,) moves only the choice, never the weights (DeepSeek-V3's
    auxiliary-loss-free balancing); groups are ranked by the sum of their two best scores."""
    logits = logits.astype(jnp.float32)
    scores = jax.nn.softmax(logits, axis=-1) if r.score == "softmax" else jax.nn.sigmoid(logits)
    choice = scores if bias is None else scores + bias[(None,) * (scores.ndim - 1)]
    if r.groups > 1:
        grouped = choice.reshape(*choice.shape[:-1], r.groups, -1)
        group_score = top_k(grouped, 2)[0].sum(-1)
        kept_groups = top_k(group_score, r.topk_groups)[1]
        keep = jax.nn.one_hot(kept_groups, r.groups, dtype=jnp.int32).sum(-2) > 0
        choice = jnp.where(keep[..., None], grouped, -jnp.inf).reshape(choice.shape)
    chosen = top_k(choice, r.k)[1]
    weights = jnp.take_along_axis(scores, chosen, axis=-1)
    if r.renormalize:
        weights = weights / (weights.sum(-1, keepdims=True) + (1e-20 if r.score == "sigmoid" else 0.0))
    return weights * r.scale, chosen.astype(jnp.int32), scores


def grouped_mlp(xs, sizes, w_in, w_down, kernel: str = "ragged_dot", rows: int = 0) -> jax.Array:
    """SwiGLU of rows xs (m, D) sorted by expert, `sizes` (E,) rows each (rows past their sum are
    room, never read), through w_in (E, D, 2, F) and w_down (E, F, D), by `grouped_matmul`. Gate
    and up are one (m, 2F) product taken apart by slices: an (m, 2, F) one would be laid out again,
    room and all, and two products would add their gradients over the room."""
    e, d, _, f = w_in.shape
    gate_up = grouped_matmul(checkpoint_name(xs, KEPT[0]), w_in.reshape(e, d, 2 * f), sizes, kernel, rows=rows)
    gate_up = checkpoint_name(gate_up, KEPT[1])
    return grouped_matmul(jax.nn.silu(gate_up[:, :f]) * gate_up[:, f:], w_down, sizes, kernel, rows=rows)


def expert_parallel(x, chosen, w_in, w_down, kernel: str = "ragged_dot", capacity: int = 0):
    """(outputs (B, T, k, D), kept (B, T, k) bool) of each copy of tokens x (B, T, D) through its
    chosen (B, T, k) experts, run on each device's own tokens. With the experts split over `mesh.expert`, each copy
    travels only to the shard holding its expert and back (`exchange`): dropless by a ragged
    all-to-all where the platform has one, else (and with a `capacity` per expert and sequence,
    0: none) by fixed buffers. The experts' hidden layer stays split over tensor (Megatron: one
    all-reduce of the outputs), and their weights, split over fsdp, are gathered where used and
    again in the backward, never kept whole (ZeRO-3)."""
    _, t, k = chosen.shape
    experts = len(w_in)
    ragged = not capacity and (exchanges_ragged() or shards_along("exp") == 1)
    places = None if ragged else jax.vmap(queue_places, (0, None))(chosen, experts)  # per sequence
    kept = places < capacity if capacity else jnp.ones(chosen.shape, bool)
    capacity = capacity or t  # dropless: a sequence gives an expert at most a copy of each token

    @partial(jax.checkpoint, policy=jax.checkpoint_policies.save_only_these_names(*KEPT), prevent_cse=False)
    def on_shard(x, chosen, w_in, w_down, places=None):
        w_in, w_down = gather(w_in, "embed", 1), gather(w_down, "embed", 2)
        bl, tl, _ = chosen.shape
        run = partial(grouped_mlp, w_in=w_in, w_down=w_down, kernel=kernel, rows=bl * tl * k)
        if places is None:
            out = by_ragged(x.reshape(bl * tl, -1), chosen.reshape(bl * tl, k), experts, run)
        else:
            out = by_capacity(x, chosen, places, experts, capacity, run)
        return sum_over(out.reshape(bl, tl, k, -1), "mlp")

    names = (ACT, ACT[:2] + (None,), ("exp", "embed", None, "mlp"), ("exp", "mlp", "embed"))
    args = (x, chosen, w_in, w_down) + (() if places is None else (places,))
    return per_shard(on_shard, names + (names[1],) * (places is not None), (*ACT[:2], None, None))(*args), kept


class RoutedExperts(nnx.Module):
    """The MLP of an MoE layer: x (B, T, D) -> (out (B, T, D), the router's statistics). With
    `capacity_factor` > 0 each expert takes at most capacity_factor * N * k / E of N tokens' k
    copies; else none is dropped. `shared` > 0 adds an always-used SwiGLU of shared * d_ff."""

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        routing: Routing,
        *,
        std: float,
        out_std: float,
        dtype,
        rngs: nnx.Rngs,
        capacity_factor: float = 0.0,
        shared: int = 0,
        kernel: str = "ragged_dot",
        bias: bool = False,
    ):
        e = routing.experts
        self.router = param(rngs, (d_model, e), ("embed", None), std)
        self.w_gate = param(rngs, (e, d_model, d_ff), EXPERT_IN, std)
        self.w_up = param(rngs, (e, d_model, d_ff), EXPERT_IN, std)
        self.w_down = param(rngs, (e, d_ff, d_model), EXPERT_OUT, out_std)
        if bias:  # moved after each step toward balance (moe.update_router_bias), never by gradients
            self.router_bias = nnx.Param(jnp.zeros((e,), jnp.float32), out_sharding=(None,), eager_sharding=False)
        if shared:
            self.shared = SwiGLU(d_model, shared * d_ff, std=std, out_std=out_std, dtype=dtype, rngs=rngs)
        self.routing, self.dtype, self.capacity_factor, self.kernel = routing, dtype, capacity_factor, kernel

    def __call__(self, x: jax.Array) -> tuple[jax.Array, dict]:
        b, t, d = x.shape
        logits = x.astype(jnp.float32) @ self.router[...]
        bias = jax.lax.stop_gradient(self.router_bias[...]) if hasattr(self, "router_bias") else None
        weights, chosen, scores = route(logits, bias, self.routing)
        w_in = jnp.stack([self.w_gate[...], self.w_up[...]], axis=2).astype(self.dtype)  # (E, D, 2, F)
        w_down = self.w_down[...].astype(self.dtype)
        capacity = 0
        if self.capacity_factor:  # per sequence, as MaxText: the same copies dropped on any mesh
            capacity = max(1, math.ceil(self.capacity_factor * t * self.routing.k / self.routing.experts))
        copies, kept = expert_parallel(x, chosen, w_in, w_down, self.kernel, capacity)
        out = jnp.einsum("btkd,btk->btd", copies.astype(jnp.float32), weights).astype(x.dtype)
        if hasattr(self, "shared"):
            out = out + self.shared(x)
        return constrain(out, ACT), router_statistics(logits, scores, chosen, kept, self.routing.experts)


def balancing_loss(load: jax.Array, score: jax.Array) -> jax.Array:
    """The load-balancing loss of layers' `router_statistics` (layers, E), as transformers'
    load_balancing_loss_func computes it: E x the sum over experts of the share of token copies it
    got times its mean score, each pooled over all the layers' tokens (k when balanced)."""
    return load.shape[-1] * jnp.sum(load.mean(0) * score.mean(0))


def router_statistics(logits, scores, chosen, kept, experts: int) -> dict:
    """One layer's routing, for the balancing losses and the metrics: the share of token copies
    each expert was given and the mean score each got (E,; sigmoid scores made to sum to 1 per
    token first), the mean squared logsumexp of the logits (the router z-loss), and the share of
    copies dropped."""
    scores = scores / scores.sum(-1, keepdims=True)
    load = jax.nn.one_hot(chosen, experts, dtype=jnp.float32).sum(-2).reshape(-1, experts).mean(0)  # sums to k
    return {
        "load": load,
        "score": scores.reshape(-1, experts).mean(0),
        "z": jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2),
        "dropped": 1.0 - kept.mean(),
    }
