"""Mixture of experts: the routed layer against a plain loop over experts, the routers, the
balancing loss against transformers', and the family training."""

import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from podtrain.errors import ConfigError
from podtrain.models import build_model
from podtrain.models.exchange import queue_places
from podtrain.models.experts import (
    RoutedExperts,
    Routing,
    balancing_loss,
    route,
    router_statistics,
)
from podtrain.models.ops import grouped_matmul
from podtrain.program.load import load_config
from podtrain.program.state import model_fns
from podtrain.program.tasks.language import next_token_loss
from podtrain.runtime.mesh import build_mesh, resolve_shape
from podtrain.sharding import logical_sharding, sharded_jit
from podtrain.train.metrics import read_metrics

from helpers import SMALL, needs_cuda_compiler, needs_libtpu, run_steps, trainer

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


def looped(layer: RoutedExperts, x: np.ndarray, capacity: int | None = None) -> tuple[np.ndarray, int]:
    """(outputs, copies dropped) of each token through each of its k experts, one at a time,
    weighted by the router; with a capacity, an expert takes the first `capacity` copies of each
    sequence (every first choice before any second)."""
    gate, up, down = (np.asarray(w[...]) for w in (layer.w_gate, layer.w_up, layer.w_down))
    out, dropped = np.zeros_like(x), 0
    for s, tokens in enumerate(x):
        weights, chosen, _ = route(tokens @ layer.router[...], None, layer.routing)
        weights, chosen = np.asarray(weights), np.asarray(chosen)
        taken = np.zeros(layer.routing.experts, int)
        for c in range(chosen.shape[1]):
            for n, token in enumerate(tokens):
                e = chosen[n, c]
                taken[e] += 1
                if capacity is not None and taken[e] > capacity:
                    dropped += 1
                    continue
                out[s, n] += weights[n, c] * ((jax.nn.silu(token @ gate[e]) * (token @ up[e])) @ down[e])
    return out, dropped


@pytest.mark.parametrize("capacity_factor", [0.0, 0.5])
def test_the_layer_is_a_loop_over_each_tokens_experts(capacity_factor):
    layer = experts_layer(Routing(experts=4, k=2), capacity_factor)
    x = np.asarray(jax.random.normal(jax.random.key(0), (2, 12, 16)))
    out, stats = layer(jnp.asarray(x))
    capacity = int(np.ceil(capacity_factor * 12 * 2 / 4)) if capacity_factor else None  # per sequence
    expected, dropped = looped(layer, x, capacity)
    np.testing.assert_allclose(out, expected, atol=1e-6, rtol=0)
    assert float(stats["dropped"]) * 48 == pytest.approx(dropped)
    assert (dropped > 0) == (capacity is not None)


def test_first_choices_queue_before_second_ones():
    chosen = jnp.asarray([[0, 1], [1, 0], [0, 2]])
    np.testing.assert_array_equal(queue_places(chosen, 3), [[0, 1], [0, 2], [1, 0]])


def test_the_shared_expert_is_added_for_every_token():
    layer = experts_layer(Routing(experts=4, k=1), shared=2)
    x = jax.random.normal(jax.random.key(1), (1, 5, 16))
    routed = looped(layer, np.asarray(x))[0]
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
    """At capacity 1.0 an expert takes 16 of a 32-token sequence's 64 copies (k=2 of 4 experts). A
    router that spreads tokens drops a few (0.10-0.19 measured); one that sends every token to one
    expert drops at least the 16 first choices past its capacity, a quarter; a router of zeros
    (every token to experts 0 and 1, the lower index first among equals) drops half."""
    state, step, batches = trainer([*small_overrides, *MOE, "train.lr=3e-3", "model.capacity_factor=1.0"], 1)
    losses, dropped = [], []
    for i in range(4):
        state, metrics = step(state, batches[i])
        losses.append(float(metrics["loss"]))
        dropped.append(float(metrics["dropped"]))
    assert losses[-1] < losses[0]
    assert {"aux_loss", "z_loss", "expert_load", "expert_load/0", "expert_load/1", "dropped"} <= set(metrics)
    assert all(0 < d < 0.25 for d in dropped), dropped
    router = state["params"]["layers"]["mlp"]["router"]
    state["params"]["layers"]["mlp"]["router"] = jax.device_put(jnp.zeros_like(router), router.sharding)
    _, collapsed = step(state, batches[4])
    assert float(collapsed["dropped"]) == 0.5 and float(collapsed["expert_load"]) == 2.0


@pytest.mark.parametrize(
    "bad,words",
    [
        ([*MOE, "model.experts_per_token=5"], "at most every expert"),
        ([*MOE, "model.first_dense_layers=2"], "leaves none"),
        ([*MOE, "model.router_groups=3"], "split the experts evenly"),
        ([*MOE, "model.router_groups=2", "model.experts_per_token=3"], "raise model.router_topk_groups"),
        ([*MOE, "mesh.expert=3", "mesh.data=1"], "a divisor of the experts"),
        (["mesh.expert=2"], "model.name=llama, which has no experts"),
    ],
)
def test_impossible_routing_is_refused(small_overrides, bad, words):
    with pytest.raises(ConfigError, match=words):
        load_config(None, [*small_overrides, *bad])


def loss_and_grads(overrides, n_devices):
    """The loss of one fixed batch and its gradients, on the mesh of `overrides`."""
    cfg = load_config(None, [*SMALL, *MOE, "model.router_z_loss_coef=0.001", *overrides])
    mesh = build_mesh(cfg.mesh, jax.devices()[:n_devices])
    fns = model_fns(cfg, mesh)

    def fn(params, tokens):
        return jax.value_and_grad(lambda p: next_token_loss(fns.module(p), None, tokens, None)[0])(params)

    tokens = jax.random.randint(jax.random.key(5), (8, 33), 0, 256)
    tokens = jax.device_put(tokens, logical_sharding(("act_batch", None), tokens.shape, mesh))
    return jax.device_get(sharded_jit(fn, mesh)(fns.init(jax.random.key(0)), tokens))


ROUTERS = {
    "softmax": [],
    "grouped-sigmoid": ["model.router=sigmoid", "model.router_groups=2", "model.router_topk_groups=1"]
    + ["model.routed_scale=2.5"],
}
DROPS = {"dropless": [], "capacity": ["model.capacity_factor=0.5"]}  # 0.5: copies dropped in every layer
EXPERT_MESHES = {  # expert 2 and 4, alone (on 4 devices) and with the other axes (on 8)
    "expert4": ["mesh.data=1", "mesh.expert=4"],
    "data2-fsdp2-expert2": ["mesh.data=2", "mesh.fsdp=2", "mesh.expert=2"],
    "expert2-fsdp2-tensor2": ["mesh.data=1", "mesh.expert=2", "mesh.fsdp=2", "mesh.tensor=2"],
    "expert2-context2-data2": ["mesh.data=2", "mesh.expert=2", "mesh.context=2"],
}
EXPERT_CASES = [("data2-fsdp2-expert2", drops, router) for drops in DROPS for router in ROUTERS] + [
    ("expert4", "capacity", "softmax"),
    ("expert4", "dropless", "grouped-sigmoid"),
    ("expert2-fsdp2-tensor2", "capacity", "grouped-sigmoid"),
    ("expert2-context2-data2", "dropless", "softmax"),  # capacity queues in the split sequence's order
]


def expert_parallel_against_one_device(mesh: str, drops: str, router: str):
    """The loss, balancing terms included, and every gradient on `mesh` against one device's."""
    routing = [*DROPS[drops], *ROUTERS[router]]
    if (drops, router) not in _one_device:
        _one_device[drops, router] = loss_and_grads([*routing, "mesh.data=1"], 1)
    loss, grads = loss_and_grads([*routing, *EXPERT_MESHES[mesh]], 4 if mesh == "expert4" else 8)
    ref_loss, ref_grads = _one_device[drops, router]
    np.testing.assert_allclose(loss, ref_loss, rtol=0, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5), grads, ref_grads)


_one_device = {}


@pytest.mark.parametrize("mesh, drops, router", EXPERT_CASES)
def test_expert_parallel_equals_one_device(mesh, drops, router):
    """Float32, with the experts split over `expert` and the batch over the other axes: the
    exchange by fixed buffers (CPU's), dropless (room for every copy) or with a capacity per
    expert and sequence that drops the same copies as one device."""
    expert_parallel_against_one_device(mesh, drops, router)


def ragged_by_gathers(n: int):
    """jax.lax.ragged_all_to_all's documented semantics over the mesh's `expert` axis of n
    shards, from all-gathers, which XLA's CPU backend runs: each shard gathers every shard's rows
    and slices and writes in those meant for it."""

    def collective(rows, into, sent_from, sent, lands_at, received, name):
        me, per = jax.lax.axis_index("expert"), len(sent) // n
        rows, sent_from, sent, lands_at = (jax.lax.all_gather(a, "expert") for a in (rows, sent_from, sent, lands_at))
        at = jnp.arange(len(into))
        for source in range(n):
            for j in range(per):
                i = me * per + j
                here = (at >= lands_at[source, i]) & (at < lands_at[source, i] + sent[source, i])
                taken = jnp.clip(sent_from[source, i] + at - lands_at[source, i], 0, rows.shape[1] - 1)
                into = jnp.where(here[:, None], rows[source][taken], into)
        return into

    return collective


@pytest.mark.parametrize("router", ROUTERS)
def test_the_ragged_exchange_equals_one_device_with_its_collective_from_gathers(monkeypatch, router):
    """The ragged exchange's own code (the sort, the counts each shard shares, where each block
    is sent from and lands, the room, the way back) with only the collective, which XLA's CPU
    backend cannot run, done by gathers to its documented semantics: data x fsdp x expert equals
    one device, dropless. The TPU compile below shows the real collective in the program."""
    from podtrain.models import exchange, experts

    monkeypatch.setattr(experts, "exchanges_ragged", lambda: True)
    monkeypatch.setattr(exchange, "ragged_exchange", ragged_by_gathers(2))
    expert_parallel_against_one_device("data2-fsdp2-expert2", "dropless", router)


def test_the_exchange_moves_the_routed_copies_and_gathers_no_tokens():
    """The forward step compiled on data=2 x fsdp=2 x expert=2 with capacity 1.25 (the fixed
    exchange, as the CPU runs it): per MoE layer each way, its all-to-all along `expert` moves
    1-1.5x the bytes of the device's routed copies, and no all-gather along `expert` carries
    tokens (all of the group's, as a dispatch by gathering does); on data=8 nothing moves along it."""
    from podtrain.planning import hlo

    for mesh in (["mesh.data=2", "mesh.fsdp=2", "mesh.expert=2"], ["mesh.data=8"]):
        cfg = load_config(None, [*SMALL, *MOE, "model.capacity_factor=1.25", *mesh])
        device_mesh = build_mesh(cfg.mesh, jax.devices())
        fns = model_fns(cfg, device_mesh)
        tokens = jax.ShapeDtypeStruct(
            (8, 33), jnp.int32, sharding=logical_sharding(("act_batch", None), (8, 33), device_mesh)
        )
        params = jax.eval_shape(fns.init, jax.random.key(0))

        def loss(params, tokens, fns=fns):
            return next_token_loss(fns.module(params), None, tokens, None)[0]

        text = sharded_jit(loss, device_mesh).lower(params, tokens).compile().as_text()
        along = [c for c in hlo.collectives(text) if "expert" in hlo.mesh_axes(c, resolve_shape(cfg.mesh, 8))]
        copies = 8 * 32 // 8 * 2 * 32 * 4  # tokens per device x k x d_model x float32
        moved = sum(c.total_bytes for c in along if c.kind == "all-to-all") / 2 / 2  # per layer, each way
        assert (1 <= moved / copies <= 1.5) if cfg.mesh.expert > 1 else not along, (moved, copies, along)
        assert not [c for c in along if c.kind == "all-gather" and c.bytes >= copies / 2], along


def test_training_steps_with_experts_split_equal_one_device():
    ref_losses, ref_params = run_steps([*SMALL, *MOE, "mesh.data=1"], 1, n_steps=2)
    losses, params = run_steps([*SMALL, *MOE, "mesh.data=2", "mesh.expert=4"], 8, n_steps=2)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-4), params, ref_params)


def test_the_megablox_kernel_computes_what_ragged_dot_does():
    """The TPU's grouped matmul, run by its interpreter: outputs and gradients of rows sorted into
    groups (one empty) equal ragged_dot's, and the room past the last group, NaN here, reaches
    neither the groups' outputs nor any gradient."""
    lhs = jax.random.normal(jax.random.key(0), (256, 128))
    rhs = jax.random.normal(jax.random.key(1), (4, 128, 256)) / 10
    sizes = jnp.asarray([60, 0, 100, 50], jnp.int32)

    def loss(kernel, lhs, rhs):
        out = grouped_matmul(lhs, rhs, sizes, kernel, interpret=True)[:210]
        return (out * jnp.arange(210.0)[:, None]).sum(), out

    room = jnp.arange(256)[:, None] >= 210
    grads = partial(jax.value_and_grad, argnums=(0, 1), has_aux=True)
    (_, mine), mine_grads = grads(partial(loss, "megablox"))(jnp.where(room, jnp.nan, lhs), rhs)
    (_, xla), xla_grads = grads(partial(loss, "ragged_dot"))(jnp.where(room, 0.0, lhs), rhs)
    np.testing.assert_allclose(mine, xla, atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(mine_grads[0][:210], xla_grads[0][:210], atol=1e-3, rtol=1e-4)
    np.testing.assert_allclose(mine_grads[1], xla_grads[1], atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("kernel", ["ragged_dot", "megablox"])
def test_equal_groups_are_a_batched_matmul(kernel):
    """Groups of one size given as an int (the capacity exchange's full slots) compute what
    ragged_dot does with those sizes."""
    lhs, rhs = jax.random.normal(jax.random.key(0), (3 * 128, 128)), jax.random.normal(jax.random.key(1), (3, 128, 128))
    mine = grouped_matmul(lhs, rhs, 128, kernel, interpret=True)
    np.testing.assert_allclose(mine, jax.lax.ragged_dot(lhs, rhs, jnp.full((3,), 128)), atol=1e-4, rtol=1e-5)


@pytest.mark.integration
@needs_libtpu
def test_experts_compile_for_tpu_with_the_ragged_exchange_and_the_megablox_kernel():
    """Ahead of time for a v5p-8 (4 chips) as expert=4: auto picks megablox, whose kernels run
    the experts' matmuls and both their gradients; the copies travel by ragged all-to-alls along
    `expert` moving the device's routed copies each way (rows sent, not the receiver's room), and
    no all-gather carries tokens. The kernels declare the cost of their room (4 x 2 of each
    shard's 2 experts' copies); counted at the rows they run, the step's matmuls come to under
    1.6x the model's FLOPs (remat's recomputation included), 2.8x as many counted at the room."""
    from podtrain.planning import plan
    from podtrain.planning import targets as hardware

    cfg = load_config(
        None,
        [*SMALL, *MOE, "model.experts=8", "model.d_model=128", "model.expert_d_ff=128", "train.seq_len=256"]
        + ["model.max_seq_len=256", "mesh.data=1", "mesh.expert=4", "device_type=tpu"],
    )
    target = hardware.target("v5p-8")
    p = plan.plan(cfg, target, remedy=False)
    assert p.cfg.model.expert_kernel == "megablox"
    kernels = {o.name.split(".")[0] for o in p.top_flops if o.op == "custom-call" and o.source.startswith("experts")}
    assert kernels == {"gmm", "tgmm"}
    assert p.fits and set(p.axes_bytes) == {"expert"}, p.axes_bytes
    copies = 8 * 256 // 4 * 2 * 128 * 4  # tokens per device x k x d_model x float32
    ragged = p.collectives["ragged-all-to-all"]
    assert ragged == 2 * 2 * 2 * copies, ragged  # 2 layers, each way, forward and backward (not recomputed)
    assert p.collectives["all-gather"] < copies / 2, p.collectives
    assert p.matmul_flops * len(target.devices) < 1.6 * p.flops_per_step


def test_sweep_tries_expert_sizes_for_a_model_with_experts(monkeypatch):
    """`plan --sweep` of 4 experts on 8 devices plans every data x fsdp x expert x tensor of 8
    but expert=8, which the config check refuses (19 shapes, 3 remat policies each)."""
    from types import SimpleNamespace

    from podtrain.planning import plan
    from podtrain.planning import targets as hardware

    planned = []

    def record(cfg, target, remedy=True):
        planned.append(tuple(getattr(cfg.mesh, a) for a in ("data", "fsdp", "expert", "tensor")))
        return SimpleNamespace(fits=True, tokens_per_sec=1.0)

    monkeypatch.setattr(plan, "plan", record)
    rows = plan.sweep(load_config(None, [*SMALL, *MOE]), hardware.target("cpu:8"))
    assert len(planned) == 3 * 19 and {shape[2] for shape in planned} == {1, 2, 4}
    assert sum(isinstance(p, str) and "divisor of the experts" in p for _, p in rows) == 3


@pytest.mark.integration
@needs_cuda_compiler
def test_experts_compile_for_a_gpu_with_the_ragged_exchange():
    """Ahead of time for an H100 x 8 as data=2 x expert=4: the copies travel by ragged
    all-to-alls along `expert` (the GPU runs them) moving the device's routed copies each way,
    forward and backward, and no all-gather carries tokens."""
    from podtrain.planning import plan
    from podtrain.planning import targets as hardware

    cfg = load_config(
        None,
        [*SMALL, *MOE, "model.experts=8", "model.d_model=128", "model.expert_d_ff=128", "train.seq_len=256"]
        + ["model.max_seq_len=256", "mesh.data=2", "mesh.expert=4", "device_type=gpu"],
    )
    p = plan.plan(cfg, hardware.target("h100x8"), remedy=False)
    copies = 8 * 256 // 8 * 2 * 128 * 4  # tokens per device x k x d_model x float32
    assert p.fits and p.collectives["ragged-all-to-all"] == 2 * 2 * 2 * copies, p.collectives
    assert p.collectives["all-gather"] < copies / 2, p.collectives


def test_the_bias_update_moves_a_skewed_router_toward_balance(small_overrides):
    """DeepSeek-V3's auxiliary-loss-free balancing alone (no balancing loss, a learning rate too
    small to move the router): a selection bias that sends nearly every token to expert 0 is moved
    down for it and up for the others after each step, and the busiest expert's load falls from
    2x the mean (every token) toward it; the loads the update reads are not logged."""
    overrides = [*small_overrides, *MOE, "model.router=sigmoid", "model.router_aux_loss_coef=0"]
    state, step, batches = trainer([*overrides, "model.router_bias_update_rate=0.01", "train.lr=1e-9"], 1)
    bias = state["params"]["layers"]["mlp"]["router_bias"]
    skewed = jnp.broadcast_to(jnp.asarray([0.05, 0.0, 0.0, 0.0]), bias.shape)
    state["params"]["layers"]["mlp"]["router_bias"] = jax.device_put(skewed, bias.sharding)
    loads = []
    for i in range(10):
        state, metrics = step(state, batches[i])
        loads.append(float(metrics["expert_load"]))
    assert loads[0] > 1.9 and np.mean(loads[-4:]) < 1.6, loads
    assert "expert_loads" not in metrics
    assert (np.asarray(state["params"]["layers"]["mlp"]["router_bias"])[:, 0] < 0.05).all()


@pytest.mark.integration
def test_moe_tiny_matches_tiny_at_the_same_steps_and_weights_per_token(tmp_path):
    """configs/moe_tiny.yaml against configs/tiny.yaml as shipped (200 steps, same data and seed, 2
    experts of half the dense MLP's width per token), each as a user runs it: the MoE's held-out loss
    at the last evaluation is the one measured (1.639; bench/moe_vs_dense.py) and level with the dense
    model's (1.641): a tie, which the MoE neither clearly wins nor loses. A router blind to the token
    (experts by position, balanced, none dropped) ends at 1.743 and one that sends every token to
    experts 0 and 1 at 2.033, so 0.03 leaves room for other CPUs and XLA versions (rerun here,
    1.6389 against 1.6407) and misses the nearer of them by 0.07."""
    configs = Path(__file__).parent.parent / "configs"
    runs = {name: tmp_path / name for name in ("tiny", "moe_tiny")}
    started = [
        subprocess.Popen(
            [sys.executable, "-m", "podtrain", "train", str(configs / f"{name}.yaml"), f"run_dir={run}"],
            env={**os.environ, "XLA_FLAGS": ""},  # one device, compiled optimised
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, run in runs.items()
    ]
    for process in started:
        _, err = process.communicate(timeout=1200)
        assert process.returncode == 0, err[-2000:]
    last = {name: [r for r in read_metrics(run) if "val_loss" in r][-1] for name, run in runs.items()}
    print({name: (r["step"], r["val_loss"]) for name, r in last.items()})
    assert last["tiny"]["step"] == last["moe_tiny"]["step"] == 200
    moe, dense = last["moe_tiny"]["val_loss"], last["tiny"]["val_loss"]
    assert moe == pytest.approx(1.639, abs=0.03) and abs(moe - dense) < 0.03, (moe, dense)
