"""mHC: the projections are doubly stochastic and weigh the right permutations, identity mixing is Llama
(n=1 and n=4), each coefficient acts on the right streams, and it shards like Llama."""

import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from podtrain.config.parallel import MeshConfig
from podtrain.models import layers, mhc
from podtrain.models.mhc import StreamMixer, permutation_mixture, sinkhorn
from podtrain.planning import cost
from podtrain.planning import targets as hardware
from podtrain.program.load import load_config
from podtrain.program.state import model_fns
from podtrain.runtime.mesh import build_mesh
from podtrain.sharding import sharded_jit

from helpers import SMALL, needs_libtpu, run_steps

MHC = SMALL + ["model.name=mhc", "model.streams=4"]


def assert_doubly_stochastic(p, atol=1e-5):
    assert bool(jnp.isfinite(p).all())
    np.testing.assert_allclose(p.sum(-1), 1, atol=atol)
    np.testing.assert_allclose(p.sum(-2), 1, atol=atol)


def test_sinkhorn_is_doubly_stochastic():
    logits = jax.random.uniform(jax.random.key(0), (256, 4, 4), minval=-1, maxval=1)
    assert_doubly_stochastic(sinkhorn(logits, 20))


def test_sinkhorn_stays_finite_at_1e4_in_bfloat16():
    identity = jnp.where(jnp.eye(4, dtype=bool), 1e4, -1e4)
    extreme = jnp.stack([identity, -identity]).astype(jnp.bfloat16)
    assert_doubly_stochastic(sinkhorn(extreme, 20))
    random_signs = (jnp.sign(jax.random.normal(jax.random.key(1), (64, 4, 4))) * 1e4).astype(jnp.bfloat16)
    p = sinkhorn(random_signs, 20)
    assert bool(jnp.isfinite(p).all()) and p.dtype == jnp.float32
    np.testing.assert_allclose(p.sum(-1), 1, atol=1e-5)  # rows are normalised last
    cotangent = jax.random.normal(jax.random.key(2), random_signs.shape)
    grad = jax.grad(lambda z: jnp.sum(sinkhorn(z, 20) * cotangent))(random_signs.astype(jnp.float32))
    assert bool(jnp.isfinite(grad).all())


def test_permutation_mixture_weighs_the_permutations_in_order():
    """Logit k weighs P_k, the k-th of itertools.permutations with (P_k x)_i = x[perm_k[i]]: a
    one-hot 1e4 logit gives P_k exactly, and softmax weights 0.3, 0.7 give 0.3 P + 0.7 P' (hand-written)."""
    perms = np.array(list(itertools.permutations(range(4))))
    np.testing.assert_array_equal(
        permutation_mixture(1e4 * jnp.eye(24), 4), np.eye(4)[perms]
    )  # row i of P_k is e_{perm_k[i]}
    logits = jnp.full((2, 6), -jnp.inf).at[0, 1].set(jnp.log(0.3)).at[0, 3].set(jnp.log(0.7)).at[1, 5].set(0.0)
    mixed = np.array([[0.3, 0.7, 0], [0, 0, 1], [0.7, 0.3, 0]])  # 0.3 P(0, 2, 1) + 0.7 P(1, 2, 0)
    reverse = np.array([[0, 0, 1], [0, 1, 0], [1, 0, 0]])  # P(2, 1, 0)
    np.testing.assert_allclose(permutation_mixture(logits, 3), np.stack([mixed, reverse]), rtol=0, atol=1e-6)


def split(x):
    """(b, t, n, C) -> the n streams (b, t, C), as the model carries them."""
    return tuple(x[:, :, j] for j in range(x.shape[2]))


def stacked(streams):
    return jnp.stack(streams, axis=2)


def _model(overrides):
    """(model functions, initial params, tokens) on one device."""
    cfg = load_config(None, overrides)
    fns = model_fns(cfg, build_mesh(MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1]))
    params = fns.init(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(3), (2, 16), 0, 256)
    return fns, params, tokens


def test_one_stream_with_identity_mixing_is_llama():
    llama, llama_params, tokens = _model(SMALL)
    mhc, params, _ = _model(SMALL + ["model.name=mhc", "model.streams=1"])
    shared = {k: v for k, v in llama_params.items() if k != "layers"}
    layers = {**params["layers"], **llama_params["layers"]}
    for mixer in ("attn_mix", "mlp_mix"):
        n_layers, size = layers[mixer]["bias"].shape  # pre, post, res: one each for n=1
        layers[mixer] = {**layers[mixer], "alpha": jnp.zeros_like(layers[mixer]["alpha"])}
        layers[mixer]["bias"] = jnp.tile(
            jnp.array([30.0, 0.0, 0.0]), (n_layers, 1)
        )  # H_pre = σ(30) = 1.0, H_post = 2σ(0) = 1
    identity = {**params, **shared, "layers": layers}
    np.testing.assert_allclose(mhc.apply(identity, tokens), llama.apply(llama_params, tokens), rtol=0, atol=1e-5)
    assert not np.allclose(
        mhc.apply(params, tokens), llama.apply(llama_params, tokens), atol=1e-3
    )  # the mixing matters


def test_four_streams_with_identity_mixing_are_llama():
    """n=4 with the bias laid out (pre n, post n, res n·n) and α=0: H_res = Sinkhorn(±30) = I, H_pre =
    σ(±30) reads stream 0 alone, H_post = 2σ(0) = 1 adds the branch to every stream. The streams start
    as copies of the embedding and get the same updates, so each is Llama's residual and their sum is
    4x Llama's; with norm_eps=1e-30 (negligible next to the mean square) the final RMSNorm divides
    the factor out. With H_post writing into stream 0 alone, the sum keeps 3 copies of the embedding
    and the logits differ."""
    llama, llama_params, tokens = _model(SMALL + ["model.norm_eps=1e-30"])
    mhc, params, _ = _model(MHC + ["model.norm_eps=1e-30"])
    shared = {k: v for k, v in llama_params.items() if k != "layers"}
    layers = {**params["layers"], **llama_params["layers"]}
    res = jnp.where(jnp.eye(4, dtype=bool), 30.0, -30.0).ravel()

    def mixing(post):
        """Llama's weights, and every mixer at α=0 with the bias (pre, post, res) for this H_post."""
        bias = jnp.tile(jnp.concatenate([jnp.array([30.0, -30, -30, -30]), jnp.array(post), res]), (2, 1))  # 2 layers
        mixers = {
            m: {**layers[m], "alpha": jnp.zeros_like(layers[m]["alpha"]), "bias": bias} for m in ("attn_mix", "mlp_mix")
        }
        return {**params, **shared, "layers": {**layers, **mixers}}

    expected, apply = llama.apply(llama_params, tokens), jax.jit(mhc.apply)
    np.testing.assert_allclose(apply(mixing([0.0, 0, 0, 0]), tokens), expected, rtol=0, atol=1e-5)
    assert not np.allclose(apply(mixing([0.0, -30, -30, -30]), tokens), expected, atol=1e-3)


@pytest.mark.parametrize("projection", ["sinkhorn", "permutations"])
def test_stream_mixer_reads_writes_and_mixes_the_right_streams(projection):
    """x_{l+1} = H_res x + H_postᵀ F(H_pre x), coefficients from the bias alone (α=0): H_pre reads
    stream 1, H_post writes F into stream 2 alone, and H_res is the cyclic shift whose entry [i, j]
    (res bias i·n + j, or the logit of permutation (1, 2, 3, 0)) moves stream j = i+1 into stream i.
    A transposed H_res would shift the other way, and H_pre or H_post on the wrong stream would show."""
    cfg = load_config(None, MHC + [f"model.projection={projection}", "model.alpha_init=0"]).model
    mixer = StreamMixer(cfg, nnx.Rngs(0))
    shift = np.roll(np.eye(4), 1, axis=1)  # shift[i, (i + 1) % 4] = 1
    if projection == "sinkhorn":
        res = np.where(shift, 30.0, -30.0).ravel()
    else:
        res = np.where(np.arange(24) == list(itertools.permutations(range(4))).index((1, 2, 3, 0)), 30.0, -30.0)
    mixer.bias[...] = jnp.asarray(np.concatenate([[-30.0, 30, -30, -30], [-30.0, -30, 0, -30], res]), jnp.float32)
    x = jax.random.normal(jax.random.key(1), (2, 3, 4, cfg.d_model))
    out = jax.jit(lambda x: stacked(mixer(split(x), lambda y: 2 * y + 1)))(x)
    expected = np.roll(np.asarray(x), -1, axis=2)  # stream i <- stream i + 1
    expected[:, :, 2] += 2 * x[:, :, 1] + 1
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def unsharded():
    return run_steps(MHC + ["mesh.data=1"], n_devices=1)


def test_sharded_equals_unsharded(unsharded):
    """Training steps of the whole model on a (2, 2, 2) mesh; the permutation mixture's sharding is
    covered by test_mixer_equals_the_reference_formulation, and tensor=4 by
    test_streams_are_a_logical_axis_never_sharded."""
    ref_losses, ref_params = unsharded
    losses, params = run_steps(MHC + ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"], n_devices=8)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    assert losses[-1] < losses[0]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-4), params, ref_params)


def test_streams_are_a_logical_axis_never_sharded():
    """On fsdp=2 x tensor=4, where tensor could split the 4 streams and the 24 coefficients: φ is split
    over fsdp along embed only, the bias is replicated, and each stream a mixer returns is split over
    the batch alone: a shard holds all its features for half of the batch."""
    cfg = load_config(None, MHC)
    mesh = build_mesh(MeshConfig(data=1, fsdp=2, tensor=4), jax.devices())
    fns = model_fns(cfg, mesh)
    mixer = fns.logical_axes["layers"]["attn_mix"]
    assert mixer["phi"] == ("layers", "embed", "streams") and mixer["bias"] == ("layers", "streams")
    abstract = fns.abstract_params["layers"]["attn_mix"]
    spec = abstract["phi"].sharding.spec
    assert spec[2] is None and spec[1] == "fsdp"
    assert abstract["bias"].sharding.is_fully_replicated
    x = jax.random.normal(jax.random.key(1), (2, 16, 4, cfg.model.d_model))
    streams = sharded_jit(lambda x: StreamMixer(cfg.model, nnx.Rngs(0))(split(x), lambda y: y), mesh)(x)
    assert len(streams) == 4
    for stream in streams:
        assert {s.data.shape for s in stream.addressable_shards} == {(1, 16, cfg.model.d_model)}


def test_bfloat16_streams_are_mixed_in_float32():
    """Equal streams stay equal under a doubly stochastic H_res: in float32 the row sums are 1 to
    ~1e-7, so streams of ones come back exactly 1 in bfloat16; H_res rounded to bfloat16 first would not."""
    cfg = load_config(None, MHC + ["model.compute_dtype=bfloat16", "model.alpha_init=3.0"]).model
    mixer = StreamMixer(cfg, nnx.Rngs(0))
    x = split(jax.random.normal(jax.random.key(1), (2, 16, 4, cfg.d_model)).astype(jnp.bfloat16))
    h_res = mixer.coefficients(x)[2]
    assert (
        float(jnp.abs(h_res - h_res.astype(jnp.bfloat16).astype(jnp.float32)).max()) > 1e-4
    )  # bfloat16 would round it
    ones = tuple(jnp.ones_like(s) for s in x)
    mixer.coefficients = lambda _: tuple(
        jnp.asarray(h) for h in StreamMixer.coefficients(mixer, x)
    )  # the diverse H_res of x
    out = stacked(mixer(ones, lambda y: jnp.zeros_like(y)))
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out, np.float32), 1.0)


# The mixing as first written (test-only reference): the RMSNorm of the flattened streams, its
# projection, Sinkhorn-Knopp as a loop over (b, t, n, n) in log space, and the three products as
# einsums accumulated in float32.
def reference_sinkhorn(logits, iters):
    def normalise(_, log_p):
        log_p = log_p - jax.nn.logsumexp(log_p, axis=-2, keepdims=True)
        return log_p - jax.nn.logsumexp(log_p, axis=-1, keepdims=True)

    return jnp.exp(jax.lax.fori_loop(0, iters, normalise, logits.astype(jnp.float32)))


def reference_mix(mixer, x, branch):
    b, t, n, c = x.shape
    flat = mixer.norm(x.reshape(b, t, n * c)).astype(jnp.float32)
    gate = jnp.repeat(mixer.alpha[...], np.array(mixer.sizes), total_repeat_length=sum(mixer.sizes))
    mixed = gate[None, None] * (flat @ mixer.phi[...]) + mixer.bias[...][None, None]
    pre, post, res = jnp.split(mixed, np.cumsum(mixer.sizes)[:2], axis=-1)
    if mixer.projection == "permutations":
        h_res = permutation_mixture(res, n)
    else:
        h_res = reference_sinkhorn(res.reshape(b, t, n, n), mixer.iters)
    h_pre, h_post = jax.nn.sigmoid(pre), 2 * jax.nn.sigmoid(post)
    y = branch(jnp.einsum("btn,btnc->btc", h_pre, x, preferred_element_type=jnp.float32).astype(x.dtype))
    mixed = jnp.einsum("btnm,btmc->btnc", h_res, x, preferred_element_type=jnp.float32) + jnp.einsum(
        "btn,btc->btnc", h_post, y, preferred_element_type=jnp.float32
    )
    return mixed.astype(x.dtype)


@pytest.mark.parametrize(
    "streams,batch,seq,projection",
    [
        (1, 2, 8, "sinkhorn"),
        (2, 3, 5, "sinkhorn"),
        (4, 4, 16, "sinkhorn"),
        (4, 1, 1, "sinkhorn"),
        (3, 4, 4, "permutations"),
    ],
)
def test_mixer_equals_the_reference_formulation(streams, batch, seq, projection):
    """Outputs and gradients (of every parameter and of the streams) on a (2, 2, 2) mesh equal the
    einsum formulation's on one device, in float32, with a random bias, norm scale and gate so
    every coefficient matters."""
    cfg = load_config(
        None, MHC + [f"model.streams={streams}", f"model.projection={projection}", "model.sinkhorn_iters=7"]
    ).model
    mixer = StreamMixer(cfg, nnx.Rngs(0))
    keys = jax.random.split(jax.random.key(2), 6)
    mixer.bias[...] = jax.random.normal(keys[0], mixer.bias.shape)
    mixer.alpha[...] = jnp.array([0.7, -0.4, 1.3])
    mixer.norm.scale[...] = 1 + 0.3 * jax.random.normal(keys[1], mixer.norm.scale.shape)
    weight = jax.random.normal(keys[2], (cfg.d_model, cfg.d_model)) / np.sqrt(cfg.d_model)
    x = jax.random.normal(keys[3], (batch, seq, streams, cfg.d_model))
    cotangent = jax.random.normal(keys[4], x.shape)
    graphdef, state = nnx.split(mixer)

    def loss(mix, state, x):
        out = mix(nnx.merge(graphdef, state), x, lambda y: jnp.tanh(y @ weight))
        return jnp.sum(out * cotangent), out

    def new(m, x, branch):
        return stacked(m(split(x), branch))

    mesh = build_mesh(MeshConfig(data=2, fsdp=2, tensor=2), jax.devices())
    grads = jax.value_and_grad(loss, argnums=(1, 2), has_aux=True)
    (_, out), (d_state, d_x) = sharded_jit(functools.partial(grads, new), mesh)(state, x)
    (_, ref_out), (ref_d_state, ref_d_x) = jax.jit(functools.partial(grads, reference_mix))(state, x)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(d_x, ref_d_x, rtol=1e-4, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), d_state, ref_d_state)


@pytest.mark.parametrize("iters", [1, 20])
def test_sinkhorn_equals_the_reference_loop(iters):
    """The unrolled projection and its gradient equal the loop over (.., n, n) in float32."""
    logits = 2 * jax.random.normal(jax.random.key(5), (3, 7, 4, 4))
    cotangent = jax.random.normal(jax.random.key(6), logits.shape)
    out, grad = jax.value_and_grad(lambda z: jnp.sum(sinkhorn(z, iters) * cotangent))(logits)
    ref, ref_grad = jax.value_and_grad(lambda z: jnp.sum(reference_sinkhorn(z, iters) * cotangent))(logits)
    np.testing.assert_allclose(out, ref, rtol=1e-5)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_tpus_elementwise_projection_gradient_equals_the_matmuls(dtype):
    """The coefficients' projection has two backwards, picked by platform: k multiply-adds per
    element on a TPU, matmuls elsewhere. Both give the same stream and weight gradients."""
    keys = jax.random.split(jax.random.key(7), 9)
    xs = tuple(jax.random.normal(keys[i], (2, 5, 16), dtype) for i in range(4))
    ws = tuple(jax.random.normal(keys[4 + i], (16, 24), dtype) for i in range(4))
    d = jax.random.normal(keys[8], (2, 5, 24))
    elementwise = mhc._streams_matmul_bwd_elementwise(xs, ws, d)
    dots = mhc._streams_matmul_bwd_dots(xs, ws, d)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=tol, atol=tol), elementwise, dots
    )
    assert jax.tree.map(lambda a: a.dtype, elementwise) == jax.tree.map(lambda a: a.dtype, dots)


@needs_libtpu
def test_the_projection_gradient_is_elementwise_on_tpu_and_matmuls_elsewhere():
    """The platform picks the backward when the program is lowered: for a TPU only the weight
    gradients are matmuls (4), for the CPU the stream gradients too (8)."""

    def matmuls_for(device):
        def spec(shape, dtype=jnp.bfloat16):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.SingleDeviceSharding(device))

        saved = tuple(spec((2, 8, 256)) for _ in range(4)), tuple(spec((256, 24)) for _ in range(4))
        program = jax.jit(mhc._streams_matmul_bwd).lower(saved, spec((2, 8, 24), jnp.float32)).as_text()
        return program.count("stablehlo.dot_general")

    assert matmuls_for(hardware.target("v6e-8").devices[0]) == 4
    assert matmuls_for(jax.devices("cpu")[0]) == 8


@pytest.mark.integration
@needs_libtpu
def test_mixing_moves_the_streams_in_the_compute_dtype_on_tpu():
    """One mixer's forward and backward, compiled ahead of time for a TPU v6e chip at mhc_3b's size
    (2048 tokens, 4 x 3072 streams, bfloat16): no buffer of float32 the streams' size in device
    memory (the float32 products and sums stay inside the passes), and the device-memory traffic
    of the mixing and its branch (a matmul) at most 60 times one bfloat16 stream of (tokens, d):
    52 with the hand-written backward, 146 with autodiff's."""
    tokens, d = 2048, 3072
    cfg = load_config(None, MHC + [f"model.d_model={d}", "model.n_heads=24", "model.compute_dtype=bfloat16"]).model
    graphdef, state = nnx.split(StreamMixer(cfg, nnx.Rngs(0)))
    device = hardware.target("v6e-8").devices[0]

    def loss(state, x, w, r):
        out = nnx.merge(graphdef, state)(x, lambda h: h @ w)
        return sum(jnp.sum((o * r_j).astype(jnp.float32)) for o, r_j in zip(out, r))

    def spec(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.SingleDeviceSharding(device))

    streams = tuple(spec((1, tokens, d)) for _ in range(4))
    args = jax.tree.map(lambda a: spec(a.shape, a.dtype), state), streams, spec((d, d)), streams
    program = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile().as_text()
    ops = cost.operations(program)
    stream_sized_f32 = [o for o in ops if re.search(rf"f32\[1,{tokens},(4,{d}|{4 * d}|{d})\]", o.shape)]
    assert not stream_sized_f32, [(o.shape, o.source) for o in stream_sized_f32]
    assert sum(o.bytes for o in ops) <= 60 * tokens * d * 2


def test_remat_full_keeps_the_branch_outputs_instead_of_recomputing_them(monkeypatch):
    """The mixing's backward needs each sub-layer's branch output (for dH_post) and the coefficients'
    projection. Kept under remat full, the backward's recomputation skips the attention's output
    projection, the MLP's down projection and both mixers' projections: exactly their forward
    FLOPs fewer than with nothing kept."""
    cfg = load_config(None, MHC + ["model.remat=full", "mesh.data=1"])
    mesh = build_mesh(cfg.mesh, jax.devices()[:1])
    fns = model_fns(cfg, mesh)
    tokens = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.train.seq_len), jnp.int32)

    def matmul_flops():
        grad = sharded_jit(jax.grad(lambda params, t: jnp.sum(fns.apply(params, t))), mesh)
        return cost.matmul_flops(grad.lower(fns.abstract_params, tokens).compile().as_text())

    kept = matmul_flops()
    monkeypatch.setitem(layers.REMAT_POLICIES, "full", jax.checkpoint_policies.nothing_saveable)
    recomputed = matmul_flops()
    m, n = cfg.model, cfg.model.streams
    per_token = m.d_model * m.d_model + m.d_ff * m.d_model + 2 * n * m.d_model * (2 * n + n * n)
    assert recomputed - kept == m.n_layers * 2 * tokens.size * per_token
