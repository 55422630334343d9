"""Context parallelism: a sequence split over `mesh.context`, attention by all-gather or a ring,
tokens reordered so that every shard does the same causal work, and packed documents kept apart
by segment ids, never by a (T, T) mask."""

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from podtrain.models.attention import context as context_module
from podtrain.models.attention import grouped_attention
from podtrain.models.attention.context import context_attention
from podtrain.program.job import build
from podtrain.program.load import load_config
from podtrain.program.state import model_fns
from podtrain.program.tasks.language import next_token_loss, sequence_loss
from podtrain.runtime.mesh import build_mesh
from podtrain.sharding import balanced_order, logical_sharding, sharded_jit

from helpers import SMALL, needs_libtpu, run_steps

SEQ = 256
LONG = [*SMALL, f"train.seq_len={SEQ}", f"model.max_seq_len={SEQ}", "model.vocab_size=64", "train.batch_size=4"]
EOS = 0  # ends a document in the packed cases


def _tokens(batch: int = 4) -> jax.Array:
    """Windows (batch, SEQ + 1) of random tokens, with an EOS every 20 to 90 tokens."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 64, (batch, SEQ + 1))
    for row in tokens:
        at = np.cumsum(rng.integers(20, 90, 8))
        row[at[at < SEQ]] = EOS
    return jnp.asarray(tokens, jnp.int32)


def loss_and_grads(overrides, n_devices, packed, reset_positions=False):
    """The next-token loss of `_tokens()` and its gradients, on the mesh of `overrides`."""
    cfg = load_config(None, [*LONG, *overrides])
    mesh = build_mesh(cfg.mesh, jax.devices()[:n_devices])
    fns = model_fns(cfg, mesh)
    loss = partial(next_token_loss, eos_id=EOS if packed else None, reset_positions=reset_positions)

    def fn(params, tokens):
        return jax.value_and_grad(lambda p: loss(fns.module(p), None, tokens, None)[0])(params)

    tokens = jax.device_put(_tokens(), logical_sharding(("act_batch", None), (4, SEQ + 1), mesh))
    return jax.device_get(sharded_jit(fn, mesh)(fns.init(jax.random.key(0)), tokens))


CASES = {  # name: (overrides, packed documents); together: context 2, 4 and 8, both strategies, every axis
    "context8-ring": (["mesh.data=1", "mesh.context=8", "context.strategy=ring"], False),
    "data2-context4-all_gather-packed": (["mesh.data=2", "mesh.context=4"], True),
    "context2-fsdp2-tensor2-ring-packed": (
        ["mesh.data=1", "mesh.context=2", "mesh.fsdp=2", "mesh.tensor=2", "context.strategy=ring"],
        True,
    ),
    "data2-context4-ring-windows-packed": (
        ["mesh.data=2", "mesh.context=4", "context.strategy=ring", "model.sliding_window=48"],
        True,
    ),
    "mhc-context2-fsdp2-tensor2-all_gather": (
        ["model.name=mhc", "mesh.data=1", "mesh.context=2", "mesh.fsdp=2", "mesh.tensor=2"],
        False,
    ),
}
_one_device = {}


@pytest.mark.parametrize("case", CASES)
def test_split_sequence_equals_one_device(case):
    """Loss and gradients with the sequence split over context shards (and the other axes), by
    either strategy, with and without packed documents, equal one device's within 1e-5."""
    overrides, packed = CASES[case]
    family = [o for o in overrides if o.startswith("model.")]
    key = (tuple(family), packed)
    if key not in _one_device:
        _one_device[key] = loss_and_grads([*family, "mesh.data=1"], 1, packed)
    loss, grads = loss_and_grads(overrides, 8, packed)
    ref_loss, ref_grads = _one_device[key]
    np.testing.assert_allclose(loss, ref_loss, rtol=0, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5), grads, ref_grads)


def test_training_steps_with_a_split_sequence_equal_one_device():
    """Whole training steps (optimizer and all) on data=2 x context=4 follow one device's."""
    steps = [*SMALL, "train.seq_len=64", "model.max_seq_len=64"]
    ref_losses, ref_params = run_steps([*steps, "mesh.data=1"], n_devices=1, n_steps=2)
    losses, params = run_steps([*steps, "mesh.data=2", "mesh.context=4", "context.strategy=ring"], 8, 2)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-4), params, ref_params)


def test_reset_positions_under_a_split_sequence_equal_one_device():
    """Positions that restart with each document travel with their tokens when reordered (were
    they left behind, causality inside a document would break)."""
    ref_loss, ref_grads = loss_and_grads(["mesh.data=1"], 1, True, reset_positions=True)
    loss, grads = loss_and_grads(["mesh.data=2", "mesh.context=4"], 8, True, reset_positions=True)
    np.testing.assert_allclose(loss, ref_loss, rtol=0, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5), grads, ref_grads)


def _positions_seen(context: int) -> np.ndarray:
    """The positions each context shard's queries have in the language task's loss (shards, T / shards)."""
    seen = []

    class Recorder:  # a model that notes the positions it is given
        cfg = type("cfg", (), {"loss_chunk": 0})

        def features(self, tokens, segments, positions):
            seen.append(positions)
            return None, jnp.zeros((*tokens.shape, 4)), {}

        def logits(self, table, x):
            return x

    mesh = build_mesh(load_config(None, ["mesh.data=1", f"mesh.context={context}"]).mesh, jax.devices()[:context])

    def positions(tokens):
        sequence_loss(Recorder(), tokens, tokens)
        return seen[-1]

    return np.asarray(sharded_jit(positions, mesh)(jnp.zeros((1, SEQ), jnp.int32)))[0].reshape(context, -1)


@pytest.mark.parametrize("context", [2, 4, 8])
def test_reordering_balances_causal_work_over_the_shards(context):
    """Each shard's count of (query, key) pairs the causal mask lets through is within 10% of the
    mean; in the natural order the last shard has about 2c - 1 times the first's."""
    work = (_positions_seen(context) + 1).sum(axis=1)
    assert np.abs(work / work.mean() - 1).max() < 0.1, work
    natural = (np.arange(SEQ).reshape(context, -1) + 1).sum(axis=1)
    assert natural[-1] / natural[0] > 2 * context - 1.5
    assert sorted(balanced_order(8, 2)) == list(range(8)) and list(balanced_order(8, 2)) == [0, 1, 6, 7, 2, 3, 4, 5]


def test_ring_attention_equals_all_gather_forward_and_backward(monkeypatch):
    """The two strategies, and attention on one device, give the same outputs and gradients, with
    shuffled positions, segments and a window; the ring folds its queries in blocks of 8."""
    monkeypatch.setattr(context_module, "RING_BLOCK", 8)  # a shard's chunks are 16 queries: two blocks each
    mesh = build_mesh(load_config(None, ["mesh.data=1", "mesh.context=4"]).mesh, jax.devices()[:4])
    b, t = 2, 128
    q, k, v = (jax.random.normal(jax.random.key(i), (b, t, n, 16)) for i, n in enumerate((4, 2, 2)))
    order = balanced_order(t, 4)
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    segments = jnp.asarray(np.repeat([[0, 1, 2, 3], [5, 5, 6, 6]], t // 4, axis=1))

    def attend(strategy, q, k, v):
        if strategy is None:
            return grouped_attention(q, k, v, segments=(segments, segments), window=40)
        shuffle = (q[:, order], k[:, order], v[:, order], positions[:, order], segments[:, order])
        out = context_attention(*shuffle, 40, strategy=strategy, causal=True, scale=16**-0.5, softcap=0.0)
        return out[:, np.argsort(order)]

    results = {}
    for strategy in (None, "all_gather", "ring"):
        fn = sharded_jit(
            lambda q, k, v, s=strategy: jax.value_and_grad(lambda *a: (attend(s, *a) ** 2).sum(), argnums=(0, 1, 2))(
                q, k, v
            ),
            mesh,
        )
        results[strategy] = fn(q, k, v)
    for strategy in ("all_gather", "ring"):
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), results[strategy], results[None]
        )


def test_the_causal_ring_computes_only_the_pairs_its_order_lets_through():
    """From the compiled program on context=8 (each shard 2 chunks of C queries): the causal ring
    computes three quarters of the (query, key) pairs of its own shard and half of every other's,
    (2c + 1) C^2 pairs, each 2 matmuls of 2 x head_dim FLOPs per head; its backward skips what
    its forward skipped: (2c + 1) / 4c of the FLOPs of the same ring without a mask."""
    from podtrain.planning.cost import matmul_flops

    mesh = build_mesh(load_config(None, ["mesh.data=1", "mesh.context=8"]).mesh, jax.devices())
    b, t, n, h, c = 2, 256, 4, 16, 8
    q, k, v = (jax.random.normal(jax.random.key(i), (b, t, heads, h)) for i, heads in enumerate((n, 2, 2)))
    positions = jnp.broadcast_to(jnp.asarray(balanced_order(t, c)), (b, t))

    def flops(fn, causal):
        def attend(q, k, v):
            out = context_attention(
                q, k, v, positions, None, None, strategy="ring", causal=causal, scale=0.25, softcap=0.0
            )
            return (out**2).sum()

        return matmul_flops(sharded_jit(fn(attend), mesh).lower(q, k, v).compile().as_text())

    chunk = t // (2 * c)
    assert flops(lambda f: f, True) == (2 * c + 1) * chunk**2 * b * n * 2 * 2 * h

    def both(f):
        return jax.grad(f, argnums=(0, 1, 2))

    assert flops(both, True) / flops(both, False) == pytest.approx((2 * c + 1) / (4 * c), rel=0.05)


@pytest.mark.parametrize("window", [0, 40])
def test_splash_over_a_split_sequence_equals_attention_on_one_device(window):
    """The splash kernel (run by its interpreter) on context=2 x tensor=2: queries in balanced order,
    every shard's keys gathered and put back in position order, the mask cut by query rows;
    outputs and gradients equal the xla attention's on one device, with segments and a window."""
    from podtrain.models.attention import splash_attention

    mesh = build_mesh(load_config(None, ["mesh.data=1", "mesh.context=2", "mesh.tensor=2"]).mesh, jax.devices()[:4])
    b, t = 2, 256
    q, k, v = (jax.random.normal(jax.random.key(i), (b, t, n, 32)) for i, n in enumerate((4, 2, 2)))
    order = balanced_order(t, 2)
    segments = jnp.asarray(np.repeat([[0, 1, 2, 3], [5, 5, 6, 6]], t // 4, axis=1))

    def split(q, k, v):
        shuffled = (x[:, order] for x in (q, k, v))
        out = splash_attention(*shuffled, interpret=True, window=window, segments=segments[:, order], order=order)
        return out[:, np.argsort(order)]

    def whole(q, k, v):
        return grouped_attention(q, k, v, segments=(segments, segments), window=window or None)

    def grads(attend):
        return jax.value_and_grad(lambda *a: (attend(*a) ** 2).sum(), argnums=(0, 1, 2))

    ours, reference = sharded_jit(grads(split), mesh)(q, k, v), jax.jit(grads(whole))(q, k, v)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4), ours, reference)


def test_a_long_split_sequence_needs_a_third_of_the_memory_and_no_t_by_t_array():
    """The compiled train step of one window of 4,096 tokens: split over context=8, it needs at
    most a third of the temporary memory per device that it needs whole (context=1), and no array
    anywhere in either program has two dimensions of 4,096 (a T x T mask or score matrix)."""
    t = 4096
    steps = [*SMALL, f"train.seq_len={t}", f"model.max_seq_len={t}", "train.batch_size=1", "data.pack=documents"]
    memory = {}
    for context in (1, 8):
        cfg = load_config(None, [*steps, "mesh.data=1", f"mesh.context={context}"])
        job = build(cfg, build_mesh(cfg.mesh, jax.devices()[:context]), data=False)
        compiled = job.step.lower(job.abstract_state, job.task.train_batch).compile()
        memory[context] = compiled.memory_analysis().temp_size_in_bytes
        square = re.findall(rf"\[[^\]]*\b{t}\b[^\]]*\b{t}\b[^\]]*\]", compiled.as_text())
        assert not square, square[:3]
    assert memory[8] <= memory[1] / 3, memory


def test_the_bytes_each_strategy_moves_along_the_context_axis():
    """Collectives are attributed to the mesh axes their devices differ along: on fsdp=2 x
    context=4 both strategies move K and V along `context` (the ring as collective permutes, the
    all-gather as gathers), and without a context axis nothing travels along it."""
    from podtrain.planning import hlo
    from podtrain.runtime.mesh import resolve_shape

    moved = {}
    for name, overrides in {
        "all_gather": ["mesh.context=4"],
        "ring": ["mesh.context=4", "context.strategy=ring"],
        "none": ["mesh.data=4"],
    }.items():
        cfg = load_config(None, [*LONG, "train.batch_size=8", "mesh.data=1", "mesh.fsdp=2", *overrides])
        job = build(cfg, build_mesh(cfg.mesh, jax.devices()), data=False)
        found = hlo.collectives(job.step.lower(job.abstract_state, job.task.train_batch).compile().as_text())
        moved[name] = hlo.by_axes(found, resolve_shape(cfg.mesh, 8))
        permuted = [c for c in found if c.kind == "collective-permute"]
        assert bool(permuted) == (name == "ring")
        assert all(hlo.mesh_axes(c, resolve_shape(cfg.mesh, 8)) == ("context",) for c in permuted)
    assert moved["all_gather"]["context"] > moved["ring"]["context"] > 0
    assert "context" not in moved["none"] and moved["none"]["fsdp"] > 0


def test_replica_groups_in_every_form_name_their_mesh_axes():
    from podtrain.planning.hlo import Collective, mesh_axes

    mesh = {"data": 2, "fsdp": 1, "context": 2, "tensor": 2}  # device id = 4 data + 2 context + tensor

    def axes(groups):
        return mesh_axes(Collective("all-gather", (), "f32", 0, None, groups, 1, "main"), mesh)

    assert axes("{{0,2},{1,3},{4,6},{5,7}}") == ("context",)
    assert axes("[4,2]<=[8]") == ("tensor",)
    assert axes("[2,4]<=[2,4]T(1,0)") == ("data", "tensor")  # ids 0 and 4: data; the other groups: tensor
    assert axes("mesh['axis_0'=2,'axis_1'=4] {'axis_0'}") == ("data",)
    # mesh position (i, j) holds device id 2j + i: along axis_1 the ids 0, 2, 4, 6
    assert axes("mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_1'}") == ("data", "context")


@pytest.mark.integration
@needs_libtpu
def test_a_split_sequence_compiles_for_tpu_with_splash():
    """Ahead of time for a v5p-8 (4 chips): 4,096 tokens over context=4 run the splash kernel (auto
    picks it), its mask cut by query rows per chip, K and V gathered along `context` (and nothing
    along another axis); the step fits a chip and no array has two dimensions of 4,096."""
    from podtrain.planning import hlo, plan
    from podtrain.planning import targets as hardware
    from podtrain.runtime.mesh import resolve_shape

    t = 4096
    cfg = load_config(
        None,
        [*SMALL, f"train.seq_len={t}", f"model.max_seq_len={t}", "train.batch_size=1", "data.pack=documents"]
        + ["mesh.data=1", "mesh.context=4", "model.compute_dtype=bfloat16", "device_type=tpu"],
    )
    target = hardware.target("v5p-8")
    ready = plan.prepared(cfg, target)
    cfg, compiled = ready.cfg, ready.compiled
    assert cfg.model.attention == "splash"
    moved = hlo.by_axes(hlo.collectives(compiled.as_text()), resolve_shape(cfg.mesh, 4))
    assert moved["context"] > 0 and set(moved) == {"context"}
    assert compiled.memory_analysis().temp_size_in_bytes < target.chip.memory
    assert not re.findall(rf"\[[^\]]*\b{t}\b[^\]]*\b{t}\b[^\]]*\]", compiled.as_text())


def test_sweep_tries_context_sizes_when_the_config_splits_the_sequence(monkeypatch):
    """`plan --sweep` on 8 devices: with mesh.context=2 every data x fsdp x context x tensor of 8 is
    planned (20 shapes, 3 remat policies each); a config that keeps the sequence whole keeps
    context=1. Each shape is planned as the config it names."""
    from types import SimpleNamespace

    from podtrain.planning import plan
    from podtrain.planning import targets as hardware

    planned = []

    def record(cfg, target, remedy=True):
        planned.append(tuple(getattr(cfg.mesh, a) for a in ("data", "fsdp", "context", "tensor")))
        return SimpleNamespace(fits=True, tokens_per_sec=1.0)

    monkeypatch.setattr(plan, "plan", record)
    target = hardware.target("cpu:8")
    plan.sweep(load_config(None, [*LONG, "mesh.context=2", "mesh.data=-1"]), target)
    assert len(planned) == 3 * 20 and len(set(planned)) == 20 and (1, 1, 8, 1) in planned
    planned.clear()
    plan.sweep(load_config(None, LONG), target)
    assert len(planned) == 3 * 10 and {shape[2] for shape in planned} == {1}


def test_the_old_context_key_is_read_as_context_strategy(tmp_path, capsys):
    """`model.context_attention`, the strategy's key before it moved beside the mesh, still reads."""
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  context_attention: ring\n")
    assert load_config(path).context.strategy == "ring"
    said = f"model.context_attention in {path} is now context.strategy; read as context.strategy=ring."
    assert said in capsys.readouterr().err
    assert load_config(path, ["context.strategy=all_gather"]).context.strategy == "all_gather"  # the new key wins


def test_mesh_context_aliases_and_a_sequence_that_does_not_split():
    from podtrain.errors import ConfigError

    assert load_config(None, ["mesh.cp=4"]).mesh.context == 4
    assert load_config(None, ["mesh.sequence=2"]).mesh.context == 2
    env = {"TPU_MESH_CONFIG": "2,4", "TPU_AXIS_NAMES": "data,cp"}
    assert load_config(None, [], environ=env).mesh.context == 4
    cfg = load_config(None, [*SMALL, "train.seq_len=36", "model.max_seq_len=36", "mesh.data=1", "mesh.context=4"])
    with pytest.raises(ConfigError, match="make it a multiple of 8"):
        build(cfg, build_mesh(cfg.mesh, jax.devices()[:4]), data=False)
    with pytest.raises(ConfigError, match="make train.seq_len a multiple of 512"):
        load_config(None, [*LONG, "mesh.context=4", "model.attention=splash"])
    with pytest.raises(ConfigError, match="which cuDNN's fused attention cannot attend across"):
        load_config(None, [*LONG, "mesh.context=2", "model.attention=cudnn", "model.compute_dtype=bfloat16"])
