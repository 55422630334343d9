"""The Llama model itself: causal, grouped-query, RoPE, precision policy."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from podtrain.config.parallel import MeshConfig
from podtrain.models import MODELS, build_model
from podtrain.models.attention import Attention
from podtrain.models.interface import LanguageModel, LanguageModelConfig
from podtrain.models.rope import apply_rope, rope_tables
from podtrain.program.load import load_config
from podtrain.runtime.mesh import build_mesh
from podtrain.sharding import sharded_jit

from helpers import LANGUAGE_FAMILIES


def small_model(overrides, extra=()):
    return build_model(load_config(None, overrides + list(extra)).model, nnx.Rngs(0))


def test_logits_do_not_see_the_future(small_overrides):
    model = small_model(small_overrides)
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 256)
    changed = tokens.at[:, 10:].set((tokens[:, 10:] + 7) % 256)
    a, b = model(tokens), model(changed)
    np.testing.assert_allclose(a[:, :10], b[:, :10], atol=1e-5)
    assert not np.allclose(a[:, 10:], b[:, 10:])


@jax.jit
def reference_attention(x, wq, wk, wv, wo, rope, kv_head):
    """Causal attention written out plainly; query head n reads key/value head kv_head[n]."""
    q, k, v = (jnp.einsum("btd,dnh->btnh", x, w) for w in (wq, wk, wv))
    q, k = apply_rope(q, rope), apply_rope(k, rope)
    k, v = k[:, :, kv_head], v[:, :, kv_head]
    scores = jnp.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(q.shape[-1])
    t = x.shape[1]
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -jnp.inf)
    return jnp.einsum("bqnh,nhd->bqd", jnp.einsum("bnqk,bknh->bqnh", jax.nn.softmax(scores, axis=-1), v), wo)


@pytest.mark.parametrize("tensor", [1, 2, 4])
@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, 2), (8, 2)])
def test_grouped_query_attention_matches_reference(n_heads, n_kv_heads, tensor):
    """Query head n shares key/value head n // (n_heads / n_kv_heads), the grouping of Llama's
    repeat_kv, also under tensor=4 where the k/v weights are copied per query head; pairing the
    heads round-robin instead (tile, not repeat) gives a different output that the test would see."""
    d_model, t = 32, 8
    std = 1 / np.sqrt(d_model)
    attn = Attention(
        d_model, n_heads, n_kv_heads, std=std, out_std=std, dtype=jnp.float32, implementation="xla", rngs=nnx.Rngs(0)
    )
    x = jax.random.normal(jax.random.key(1), (2, t, d_model))
    rope = rope_tables(t, d_model // n_heads, 10000.0)
    mesh = build_mesh(MeshConfig(data=1, fsdp=1, tensor=tensor), jax.devices()[:tensor])
    out = sharded_jit(lambda x: attn(x, rope), mesh)(x)
    weights = (attn.wq[...], attn.wk[...], attn.wv[...], attn.wo[...])
    grouped = reference_attention(x, *weights, rope, jnp.arange(n_heads) // (n_heads // n_kv_heads))
    round_robin = reference_attention(x, *weights, rope, jnp.arange(n_heads) % n_kv_heads)
    np.testing.assert_allclose(out, grouped, rtol=1e-5, atol=1e-5)
    assert np.abs(out - round_robin).max() > 1e-2


def test_rope_scores_depend_only_on_relative_position():
    """q·k after RoPE is a function of i - j alone: the same at (3, 1) and (10, 8), not at (3, 2)."""
    q, k = jax.random.normal(jax.random.key(0), (2, 16))
    # q and k at each of 16 positions: (batch 2, seq 16, 1 head, head_dim 16)
    rq, rk = apply_rope(
        jnp.broadcast_to(jnp.stack([q, k])[:, None, None], (2, 16, 1, 16)), rope_tables(16, 16, 10000.0)
    )[:, :, 0]
    score = rq @ rk.T  # score[i, j] = rope(q, i) · rope(k, j)
    np.testing.assert_allclose(score[3, 1], score[10, 8], rtol=1e-5)
    assert abs(score[3, 1] - score[3, 2]) > 1e-2


def test_rope_rotates_half_split_pairs():
    """Llama's (and HF's) rotate-half layout: x[m] and x[m + d/2] turn by pos * theta^(-2m/d), not
    the interleaved pairs (x[2m], x[2m+1]); position 0 is the identity. Rows are the images of e_0..e_3."""
    cos, sin = rope_tables(4, 4, 100.0)
    images = apply_rope(jnp.broadcast_to(jnp.eye(4)[:, None, None, :], (4, 4, 1, 4)), (cos, sin))[
        :, :, 0
    ]  # (basis, pos, d)
    c0, s0, c1, s1 = np.cos(3.0), np.sin(3.0), np.cos(0.3), np.sin(0.3)  # pos 3: angles 3 * 100^0 and 3 * 100^(-1/2)
    expected = np.array([[c0, 0, s0, 0], [0, c1, 0, s1], [-s0, 0, c0, 0], [0, -s1, 0, c1]])
    np.testing.assert_allclose(images[:, 3], expected, atol=1e-6)
    np.testing.assert_array_equal(images[:, 0], np.eye(4))


def test_bfloat16_compute_keeps_float32_params_and_logits(small_overrides):
    model = small_model(small_overrides, ["model.compute_dtype=bfloat16"])
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(model)))
    logits = model(jax.random.randint(jax.random.key(0), (2, 8), 0, 256))
    assert logits.dtype == jnp.float32
    # accumulated in float32, not rounded to bfloat16 and cast afterwards
    assert (logits != logits.astype(jnp.bfloat16).astype(jnp.float32)).mean() > 0.9


@pytest.mark.parametrize("name", LANGUAGE_FAMILIES)
def test_every_language_family_implements_the_interface(small_overrides, name):
    """What the language task and sampling call (models/interface.py), checked on a built model:
    the methods exist, `logits` of `features`' head and x is the forward pass, and decoding a prompt in two
    calls through the cache gives the same logits."""
    assert issubclass(MODELS[name].config, LanguageModelConfig)
    model = small_model(small_overrides, [f"model.name={name}"])
    assert isinstance(model, LanguageModel)
    tokens = jax.random.randint(jax.random.key(2), (2, 12), 0, 256)
    logits = model(tokens)
    assert logits.shape == (2, 12, 256) and logits.dtype == jnp.float32
    head, x, aux = model.features(tokens)
    np.testing.assert_allclose(model.logits(head, x), logits, atol=1e-6)
    assert all(jnp.shape(v) == () for v in aux.values())
    first, cache = model.decode(tokens[:, :8], model.init_cache(2, 16), jnp.int32(0))
    rest, _ = model.decode(tokens[:, 8:], cache, jnp.int32(8))
    np.testing.assert_allclose(jnp.concatenate([first, rest], axis=1), logits, atol=1e-4)


def test_a_sliding_window_hides_what_lies_beyond_it(small_overrides):
    """With windows of 4 positions in both layers, position t sees tokens back to t - 6 (3 per
    layer) and no further; with the first layer attending to everything, it sees them all."""
    tokens = jax.random.randint(jax.random.key(1), (1, 16), 0, 256)
    changed = tokens.at[:, 0].set((tokens[:, 0] + 7) % 256)
    model = small_model(small_overrides, ["model.sliding_window=4"])
    a, b = model(tokens), model(changed)
    np.testing.assert_allclose(a[:, 7:], b[:, 7:], atol=1e-6)
    assert not np.allclose(a[:, 6], b[:, 6])
    model = small_model(small_overrides, ["model.sliding_window=4", "model.full_attention_layers=[0]"])
    assert not np.allclose(model(tokens)[:, 15], model(changed)[:, 15])


def test_flops_count_a_sliding_layers_window_not_the_sequence():
    from podtrain.models.llama import flops_per_token

    cfg = load_config(None, ["model.head_dim=48"]).model
    full = flops_per_token(cfg, 10**6, 256)
    assert full == 6 * 10**6 + 12 * cfg.n_heads * 48 * (256 + 1) / 2 * cfg.n_layers  # keys seen, causally
    windowed = dataclasses.replace(cfg, sliding_window=64, full_attention_layers=[0])
    seen = (64 * 65 / 2 + (256 - 64) * 64) / 256  # 1..64 keys for the first 64 queries, then 64 each
    assert full - flops_per_token(windowed, 10**6, 256) == pytest.approx(
        12 * cfg.n_heads * 48 * ((256 + 1) / 2 - seen) * (cfg.n_layers - 1), rel=1e-12
    )
