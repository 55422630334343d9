"""Mixture of experts: the routed layer against a plain loop over experts, the routers, the
balancing loss against transformers', and the family training."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from podtrain.config.load import load_config
from podtrain.errors import ConfigError
from podtrain.models import build_model
from podtrain.models.experts import RoutedExperts, Routing, balancing_loss, queue_places, route, router_statistics

from helpers import trainer

MOE = ["model.name=moe", "model.experts=4", "model.experts_per_token=2", "model.expert_d_ff=32"]


def experts_layer(routing: Routing, capacity_factor=0.0, shared=0) -> RoutedExperts:
    return RoutedExperts(
        16,
        8,
        routing,
        std=0.3,
        out_std=0.3,
        dtype=jnp.float32,
        rngs=nnx.Rngs(3),
        capacity_factor=capacity_factor,
        shared=shared,
    )


def looped(layer: RoutedExperts, x: np.ndarray, capacity: int | None = None) -> np.ndarray:
    """Each token through each of its k experts, one at a time, weighted by the router; with a
    capacity, an expert takes the first `capacity` copies (every first choice before any second)."""
    tokens = x.reshape(-1, x.shape[-1])
    weights, chosen, _ = route(tokens @ layer.router[...], None, layer.routing)
    weights, chosen = np.asarray(weights), np.asarray(chosen)
    gate, up, down = (np.asarray(w[...]) for w in (layer.w_gate, layer.w_up, layer.w_down))
    out, taken = np.zeros_like(tokens), np.zeros(layer.routing.experts, int)
    for c in range(chosen.shape[1]):
        for n, token in enumerate(tokens):
            e = chosen[n, c]
            taken[e] += 1
            if capacity is not None and taken[e] > capacity:
                continue
            out[n] += weights[n, c] * ((jax.nn.silu(token @ gate[e]) * (token @ up[e])) @ down[e])
    return out.reshape(x.shape)


@pytest.mark.parametrize("capacity_factor", [0.0, 0.5])
def test_the_layer_is_a_loop_over_each_tokens_experts(capacity_factor):
    layer = experts_layer(Routing(experts=4, k=2), capacity_factor)
    x = np.asarray(jax.random.normal(jax.random.key(0), (2, 12, 16)))
    out, stats = layer(jnp.asarray(x))
    capacity = int(np.ceil(capacity_factor * 24 * 2 / 4)) if capacity_factor else None
    np.testing.assert_allclose(out, looped(layer, x, capacity), atol=1e-6, rtol=0)
    load = np.asarray(stats["load"]) * 24  # copies routed to each expert
    dropped = 0 if capacity is None else np.maximum(load - capacity, 0).sum()
    assert float(stats["dropped"]) * 48 == pytest.approx(dropped)
    assert (dropped > 0) == (capacity is not None)


def test_first_choices_queue_before_second_ones():
    chosen = jnp.asarray([[0, 1], [1, 0], [0, 2]])
    np.testing.assert_array_equal(queue_places(chosen, 3), [[0, 1], [0, 2], [1, 0]])


def test_the_shared_expert_is_added_for_every_token():
    layer = experts_layer(Routing(experts=4, k=1), shared=2)
    x = jax.random.normal(jax.random.key(1), (1, 5, 16))
    routed = looped(layer, np.asarray(x))
    np.testing.assert_allclose(layer(x)[0], routed + layer.shared(x), atol=1e-6)


def test_the_sigmoid_router_chooses_in_the_best_groups_with_its_bias():
    """DeepSeek-V3: biased scores choose, within the topk_groups groups whose two best biased
    scores sum highest; the weights are the unbiased scores, normalised, times the scale."""
    r = Routing(experts=8, k=2, score="sigmoid", groups=4, topk_groups=2, scale=2.5)
    logits = jax.random.normal(jax.random.key(4), (64, 8))
    bias = jnp.linspace(-0.3, 0.3, 8)
    weights, chosen, scores = route(logits, bias, r)
    s, biased = np.asarray(jax.nn.sigmoid(logits)), np.asarray(jax.nn.sigmoid(logits)) + np.asarray(bias)
    for n in range(64):
        groups = biased[n].reshape(4, 2).sum(-1)  # two experts a group: their two best are both
        allowed = np.repeat(np.isin(np.arange(4), np.argsort(-groups)[:2]), 2)
        want = np.argsort(-np.where(allowed, biased[n], -np.inf))[:2]
        assert set(np.asarray(chosen[n])) == set(want)
        np.testing.assert_allclose(weights[n], 2.5 * s[n, chosen[n]] / s[n, chosen[n]].sum(), rtol=1e-6)
    np.testing.assert_allclose(scores, s, rtol=1e-6)


def test_the_balancing_loss_is_transformers():
    torch = pytest.importorskip("torch")
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    layers = [jax.random.normal(jax.random.key(i), (40, 8)) * (1 + i) for i in range(3)]
    stats = []
    for logits in layers:
        _, chosen, scores = route(logits, None, Routing(experts=8, k=2))
        stats.append(router_statistics(logits, scores, chosen, jnp.ones(chosen.shape, bool), 8))
    ours = balancing_loss(jnp.stack([s["load"] for s in stats]), jnp.stack([s["score"] for s in stats]))
    theirs = load_balancing_loss_func(tuple(torch.tensor(np.asarray(x)) for x in layers), 8, 2)
    np.testing.assert_allclose(float(ours), float(theirs), rtol=1e-6)


def test_dense_layers_come_first_and_the_loss_holds_the_balancing_terms(small_overrides):
    cfg = load_config(None, [*small_overrides, *MOE, "model.n_layers=3", "model.first_dense_layers=1"]).model
    model = build_model(cfg, nnx.Rngs(0))
    assert model.dense_layers.mlp.w_gate.shape == (1, 32, 64) and model.layers.mlp.w_gate.shape == (2, 4, 32, 32)
    _, _, aux = model.features(jax.random.randint(jax.random.key(0), (2, 16), 0, 256))
    assert sorted(aux) == ["aux_loss", "expert_load", "expert_load/1", "expert_load/2", "loss", "z_loss"]
    np.testing.assert_allclose(aux["loss"], 0.01 * aux["aux_loss"], rtol=1e-6)
    assert aux["expert_load"] >= 1 and aux["aux_loss"] >= 2 * 0.99  # k when balanced, more when not


def test_an_moe_trains_and_reports_its_routing(small_overrides):
    state, step, batches = trainer([*small_overrides, *MOE, "train.lr=3e-3", "model.capacity_factor=1.0"], 1)
    losses = []
    for i in range(4):
        state, metrics = step(state, batches[i])
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0]
    assert {"aux_loss", "z_loss", "expert_load", "expert_load/0", "expert_load/1", "dropped"} <= set(metrics)
    assert 0 <= float(metrics["dropped"]) < 1


@pytest.mark.parametrize(
    "bad,words",
    [
        (["model.experts_per_token=5"], "at most every expert"),
        (["model.first_dense_layers=2"], "leaves none"),
        (["model.router_groups=3"], "split the experts evenly"),
        (["model.router_groups=2", "model.experts_per_token=3"], "raise model.router_topk_groups"),
    ],
)
def test_impossible_routing_is_refused(small_overrides, bad, words):
    with pytest.raises(ConfigError, match=words):
        load_config(None, [*small_overrides, *MOE, *bad])
