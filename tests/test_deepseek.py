"""DeepSeek-V3 as podtrain's MoE with multi-head latent attention: a random transformers model
(queries through q_lora_rank, interleaved rotary pairs, two dense layers then two MoE layers with
grouped sigmoid routing, a random selection bias and shared experts) imported, compared logit for logit
and token for token, exported back bit for bit; the decode cache holds the latents alone; the
model split over fsdp x tensor x expert trains as on one device; the TPU kernel takes its heads."""

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from podtrain.cli import main
from podtrain.errors import ConfigError
from podtrain.interop.hf.config_json import export_family, hf_config
from podtrain.models import build_model
from podtrain.models.attention import grouped_attention, splash_attention
from podtrain.program import sampler
from podtrain.program.adapters import weights_adapted
from podtrain.program.load import load_config
from podtrain.train.run import Run
from safetensors.numpy import save_file

from helpers import SMALL, run_steps
from test_hf import TOKENS, torch_logits
from test_hf_families import SIZES, exports_back, hf_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

DEEPSEEK = {
    **SIZES,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 2,
    "num_key_value_heads": 4,
    "moe_intermediate_size": 32,
    "q_lora_rank": 24,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 6,
    "v_head_dim": 12,
    "rope_interleave": True,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "n_shared_experts": 2,
    "routed_scaling_factor": 2.5,
}
# A DeepSeek-style MoE with latent attention as podtrain keys, small enough for 8 fake devices on 2 cores.
MLA = [
    "model.name=moe",
    "model.n_layers=3",
    "model.first_dense_layers=1",
    "model.experts=4",
    "model.experts_per_token=2",
    "model.expert_d_ff=32",
    "model.shared_experts=1",
    "model.router=sigmoid",
    "model.router_groups=2",
    "model.router_topk_groups=1",
    "model.attention_kind=mla",
    "model.q_lora_rank=16",
    "model.kv_lora_rank=8",
    "model.qk_nope_head_dim=8",
    "model.qk_rope_head_dim=4",
    "model.v_head_dim=12",
]


def test_deepseek_v3_imports_generates_and_exports_like_transformers(tmp_path, capsys):
    model = hf_model(tmp_path / "hf", "deepseek_v3", DEEPSEEK)
    # a multi-token prediction layer after the last, as the Hub's DeepSeek-V3 keeps: left behind, and said so
    save_file({"model.layers.4.eh_proj.weight": np.ones((64, 128), np.float32)}, tmp_path / "hf" / "mtp.safetensors")
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), str(tmp_path / "run")]) == 0
    assert "num_nextn_predict_layers=1 (DeepSeek's multi-token prediction) is ignored" in capsys.readouterr().out
    cfg, fns, params = Run.at(tmp_path / "run").language_model()
    assert (cfg.model.attention_kind, cfg.model.first_dense_layers, cfg.model.router) == ("mla", 2, "sigmoid")
    theirs = torch_logits(model, TOKENS)
    difference = np.abs(np.asarray(fns.apply(params, TOKENS)) - theirs).max()
    assert difference < 1e-4, difference
    # the interleaved rotary layout matters: read as halves, the logits move
    halves = dataclasses.replace(cfg.model, rope_interleave=False)
    assert np.abs(np.asarray(nnx.merge(*_split(halves, params))(TOKENS)) - theirs).max() > 1e-2

    prompt = TOKENS[0, :7]
    with torch.no_grad():
        expected = model.generate(torch.from_numpy(prompt[None]), max_new_tokens=16, do_sample=False, min_new_tokens=0)
    assert (
        sampler.generate(fns, params, [prompt.tolist()], 16, max_len=cfg.model.max_seq_len)[0].tokens
        == expected[0, 7:].tolist()
    )

    exports_back(tmp_path, "deepseek_v3", model)


def test_deepseek_v2_lite_s_attention_with_yarn_imports_like_transformers(tmp_path):
    """Queries in one projection (q_lora_rank null), rotary halves, and YaRN from a context of 16
    whose mscale_all_dim scales the scores too: logits as transformers', and back bit for bit."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 0.707}
    options = {"q_lora_rank": None, "rope_interleave": False, "rope_parameters": {**yarn, "mscale_all_dim": 0.707}}
    model = hf_model(tmp_path / "hf", "deepseek_v3", {**DEEPSEEK, **options})
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), str(tmp_path / "run")]) == 0
    cfg, fns, params = Run.at(tmp_path / "run").language_model()
    assert (cfg.model.q_lora_rank, cfg.model.rope_mscale_all_dim) == (0, 0.707)
    difference = np.abs(np.asarray(fns.apply(params, TOKENS)) - torch_logits(model, TOKENS)).max()
    assert difference < 1e-4, difference
    exports_back(tmp_path, "deepseek_v3", model)


def _split(model_cfg, params):
    """(graphdef, state) of a model of `model_cfg` holding `params`."""
    graphdef, state = nnx.split(build_model(model_cfg, nnx.Rngs(0)))
    nnx.replace_by_pure_dict(state, params)
    return graphdef, state


def test_the_decode_cache_holds_the_latent_and_the_rotated_key_alone(small_overrides):
    """Per position and layer, kv_lora_rank + qk_rope_head_dim values (8 + 4), not 2 x heads x
    head dims; prefill then one-token steps give the logits of the whole sequence at once."""
    cfg = load_config(None, [*small_overrides, *MLA]).model
    model = build_model(cfg, nnx.Rngs(0))
    cache = model.init_cache(2, 32)
    per_position = sum(c.nbytes for c in jax.tree.leaves(cache)) / (2 * 32)
    assert per_position == (8 + 4) * cfg.n_layers * jnp.dtype(cfg.compute_dtype).itemsize == 144
    tokens = jax.random.randint(jax.random.key(1), (2, 20), 0, cfg.vocab_size)
    whole = np.asarray(model(tokens))
    logits, cache = model.decode(tokens[:, :12], cache, jnp.int32(0))
    steps = [logits]
    for p in range(12, 20):
        logits, cache = model.decode(tokens[:, p : p + 1], cache, jnp.int32(p))
        steps.append(logits)
    assert [c.shape for c in jax.tree.leaves(cache)] == [(cfg.n_layers, 2, 32, 12)]
    np.testing.assert_allclose(np.concatenate(steps, axis=1), whole, rtol=0, atol=1e-5)


def test_latent_attention_split_over_fsdp_tensor_and_expert_trains_as_one_device():
    overrides = [*SMALL, *MLA]
    ref_losses, ref_params = run_steps([*overrides, "mesh.data=1"], 1, n_steps=2)
    mesh = ["mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2", "mesh.expert=2"]
    losses, params = run_steps([*overrides, *mesh], 8, n_steps=2)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-4), params, ref_params)


@pytest.mark.parametrize(
    "bad, words",
    [
        (["model.attention=cudnn"], "model.attention_kind=mla runs on the xla or splash attention"),
        (["mesh.context=2", "mesh.data=1"], "model.attention_kind=mla runs on the xla or splash attention"),
        (["model.qk_norm=true"], "model.attention_kind=mla has no model.qk_norm=True"),
        (["model.qk_rope_head_dim=5"], "RoPE rotates pairs"),
    ],
)
def test_what_latent_attention_does_not_compute_is_refused(small_overrides, bad, words):
    with pytest.raises(ConfigError, match=words):
        load_config(None, [*small_overrides, *MLA, *bad])


def test_lora_on_latent_attention_is_refused_and_on_its_mlps_allowed(small_overrides, tmp_path):
    lora = [*small_overrides, *MLA, "train.lora.rank=4", f"train.init_from={tmp_path}"]
    with pytest.raises(ConfigError, match="q_proj, v_proj, and model.attention_kind=mla's latent attention"):
        weights_adapted(load_config(None, [*lora, "train.lora.targets=[q_proj,v_proj,up_proj]"]))
    assert weights_adapted(load_config(None, [*lora, "train.lora.targets=[up_proj]"])) == {"w_up"}


@pytest.mark.integration
def test_the_splash_kernel_takes_values_narrower_than_queries_and_keys():
    """Latent attention's heads: keys of nope + rope dims, values of v_head_dim. The TPU kernel (run
    by its interpreter) gives the xla path's outputs and gradients."""
    q, k, v = (
        jax.random.normal(key, (1, 256, 2, d)) for key, d in zip(jax.random.split(jax.random.key(0), 3), (24, 24, 16))
    )
    splash, xla = partial(splash_attention, interpret=True, scale=0.2), partial(grouped_attention, scale=0.2)
    np.testing.assert_allclose(splash(q, k, v), xla(q, k, v), rtol=0, atol=1e-5)
    grads = [jax.grad(lambda *a, f=f: (f(*a) ** 2).sum(), (0, 1, 2))(q, k, v) for f in (splash, xla)]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-4), *grads)


def test_a_latent_attention_moe_exports_as_deepseek_v3_only(small_overrides):
    """A model trained here with latent attention and DeepSeek's router: Mixtral has no place for
    it (the error names DeepSeek-V3), DeepSeek-V3's config.json holds it, its heads as kv heads."""
    model = load_config(None, [*small_overrides, *MLA]).model
    with pytest.raises(ConfigError, match="mixtral .* no place for model.attention_kind=mla.*hf_type=deepseek_v3"):
        export_family(model)
    config = hf_config(dataclasses.replace(model, hf_type="deepseek_v3"), {}, "float32")
    expected = {"model_type": "deepseek_v3", "num_key_value_heads": 4, "first_k_dense_replace": 1}
    expected |= {"q_lora_rank": 16, "kv_lora_rank": 8, "n_group": 2, "n_shared_experts": 1}
    assert {name: config[name] for name in expected} == expected
