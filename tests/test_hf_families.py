"""The Hugging Face families beyond Llama as options of podtrain's decoder: each model_type built
at random by transformers with its own options on (GQA, an explicit head_dim, windows shorter
than the sequence, biases and q/k norms away from their initial values), imported, compared
logit for logit and token for token with transformers, and exported back bit for bit."""

import json

import numpy as np
import pytest
from podtrain.cli import main
from podtrain.program import sampler
from podtrain.train.run import Run
from safetensors.numpy import load_file

from test_hf import TOKENS, podtrain_logits, torch_logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SIZES = {
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.2,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}
# model_type, its options; windows of 8 positions against sequences of 40 and generation to 23.
FAMILIES = {
    "llama-biases": ("llama", {"attention_bias": True, "tie_word_embeddings": False}),
    "mistral": ("mistral", {"sliding_window": 8, "head_dim": 24, "tie_word_embeddings": False}),
    # layer 0 attends to everything, layer 1 slides (max_window_layers); YaRN from a context of 16
    "qwen2": (
        "qwen2",
        {
            "use_sliding_window": True,
            "sliding_window": 8,
            "max_window_layers": 1,
            "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        },
    ),
    "qwen3": (
        "qwen3",
        {
            "head_dim": 24,
            "attention_bias": True,
            "use_sliding_window": True,
            "sliding_window": 8,
            "max_window_layers": 1,
        },
    ),
    # fused qkv and gate_up weights, a quarter of each head rotated, a window on every layer
    "phi3": ("phi3", {"partial_rotary_factor": 0.25, "sliding_window": 8, "tie_word_embeddings": False}),
    # soft-caps low enough that tanh bends the scores and logits; layer 0 slides (even layers)
    "gemma2": (
        "gemma2",
        {
            "head_dim": 24,
            "query_pre_attn_scalar": 20,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 5.0,
            "sliding_window": 8,
            "hidden_activation": "gelu_pytorch_tanh",
        },
    ),
    # mixtures of experts, their per-expert tensors as the Hub stores them; Qwen3-MoE's weights unnormalised
    "mixtral": (
        "mixtral",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8, "tie_word_embeddings": False},
    ),
    "qwen3_moe": (
        "qwen3_moe",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "norm_topk_prob": False,
            "head_dim": 24,
            "tie_word_embeddings": False,
        },
    ),
    # layer 0 slides with RoPE base 10,000, layer 1 attends to all with base 1e6 stretched linearly
    "gemma3": (
        "gemma3_text",
        {
            "head_dim": 24,
            "query_pre_attn_scalar": 24,
            "sliding_window": 8,
            "sliding_window_pattern": 2,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
            "tie_word_embeddings": False,
        },
    ),
}


def hf_model(folder, model_type, options, seed=0):
    """A random model of `model_type` saved as safetensors in `folder`, in float32, eager attention."""
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(model_type, **{**SIZES, **options})
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():  # norms start at one and biases at zero; random ones test their mapping
        for name, p in [*model.named_parameters(), *model.named_buffers()]:  # DeepSeek's router bias: a buffer
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(folder, safe_serialization=True)
    return model


@pytest.mark.parametrize("variant", FAMILIES)
def test_family_imports_generates_and_exports_like_transformers(tmp_path, variant):
    model_type, options = FAMILIES[variant]
    model = hf_model(tmp_path / "hf", model_type, options)
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), str(tmp_path / "run")]) == 0
    cfg, fns, params = Run.at(tmp_path / "run").language_model()
    difference = np.abs(np.asarray(fns.apply(params, TOKENS)) - torch_logits(model, TOKENS)).max()
    assert difference < 1e-4, difference
    if cfg.model.name == "moe":  # the balancing loss over both layers' routing, as transformers reports it
        with torch.no_grad():
            theirs = model(torch.from_numpy(TOKENS), output_router_logits=True).aux_loss
        ours = fns.module(params).features(TOKENS)[2]["aux_loss"]
        np.testing.assert_allclose(float(ours), float(theirs), rtol=1e-5)

    prompt = TOKENS[0, :7]
    with torch.no_grad():
        theirs = model.generate(torch.from_numpy(prompt[None]), max_new_tokens=16, do_sample=False, min_new_tokens=0)
    assert (
        sampler.generate(fns, params, [prompt.tolist()], 16, max_len=cfg.model.max_seq_len)[0].tokens
        == theirs[0, 7:].tolist()
    )
    windows = cfg.model.layer_windows()
    if windows and all(windows):  # every layer slides: the cache is a ring as long as the window, wrapped above
        assert fns.module(params).init_cache(1, cfg.model.max_seq_len)[0].shape[2] == max(windows) < 23

    exports_back(tmp_path, model_type, model)


def exports_back(tmp_path, model_type, model):
    """tmp_path/run exported to tmp_path/out is tmp_path/hf again: `model_type`, every tensor
    equal, and transformers loads it whole and computes what `model` does."""
    assert main(["convert", "--to-hf", str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == model_type
    source, exported = (load_file(tmp_path / d / "model.safetensors") for d in ("hf", "out"))
    assert sorted(exported) == sorted(source)
    for name, tensor in source.items():
        assert np.array_equal(exported[name], tensor), name
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", output_loading_info=True, attn_implementation="eager"
    )
    assert not any(info.values()), info
    assert np.array_equal(torch_logits(reloaded.float().eval(), TOKENS), torch_logits(model, TOKENS))


def test_an_export_to_a_family_that_lacks_an_option_is_refused(tmp_path, capsys):
    hf_model(tmp_path / "hf", "qwen3", {})
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), str(tmp_path / "run")]) == 0
    config = tmp_path / "run" / "config.yaml"
    config.write_text(config.read_text().replace("hf_type: qwen3", "hf_type: mistral"))
    capsys.readouterr()
    assert main(["convert", "--to-hf", str(tmp_path / "run"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "model_type mistral (model.hf_type) has no place for model.qk_norm=true; set model.hf_type=qwen3" in err


def test_a_parameter_the_hub_model_cannot_hold_is_a_clear_error(tmp_path, capsys):
    """A router bias (DeepSeek-V3's balancing) has no tensor in a Mixtral checkpoint: importing one
    with it asked for names it, and writes no run."""
    hf_model(tmp_path / "hf", *FAMILIES["mixtral"])
    capsys.readouterr()
    args = [str(tmp_path / "hf"), str(tmp_path / "run"), "model.router_bias_update_rate=0.001"]
    assert main(["convert", "--from-hf", *args]) == 2
    assert "has no place for this model config's layers/mlp/router_bias" in capsys.readouterr().err
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_config_fields_left_out_take_transformers_defaults():
    """A config.json without layer_types slides by the family's pattern (Gemma 2: every other layer,
    Gemma 3: five in six), and fields left out take transformers' defaults, not podtrain's."""
    from podtrain.interop.hf.config_json import model_keys

    sizes = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4}
    gemma2 = model_keys({"model_type": "gemma2", "num_hidden_layers": 6, **sizes}, "here")
    assert gemma2["full_attention_layers"] == [1, 3, 5] and gemma2["sliding_window"] == 4096
    assert (gemma2["attn_softcap"], gemma2["final_softcap"], gemma2["query_pre_attn_scalar"]) == (50.0, 30.0, 256)
    assert gemma2["head_dim"] == 256 and gemma2["tie_embeddings"]
    gemma3 = model_keys({"model_type": "gemma3_text", "num_hidden_layers": 12, **sizes}, "here")
    assert gemma3["full_attention_layers"] == [5, 11] and gemma3["attn_softcap"] == 0.0
    assert (gemma3["rope_theta"], gemma3["rope_local_theta"]) == (1e6, 1e4)
    assert model_keys({"model_type": "mistral", "num_hidden_layers": 2, **sizes}, "here")["sliding_window"] == 4096
    assert model_keys({"model_type": "qwen3", "num_hidden_layers": 2, **sizes}, "here")["head_dim"] == 128


ROPE_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 3.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
    "yarn-untruncated": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 16, "beta_slow": 2, "truncate": False},
    "yarn-deepseek": {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707},
}


@pytest.mark.parametrize("scaling", ROPE_SCALINGS)
def test_rope_scaling_equals_transformers_frequencies(scaling):
    """cos and sin at positions up to 4096 from config.json's rope parameters, read as podtrain's
    keys, against transformers' own inverse frequencies and attention factor for that rope type."""
    import jax.numpy as jnp
    from flax import nnx
    from podtrain.interop.hf.config_json import model_keys
    from podtrain.models import build_model
    from podtrain.program.load import load_config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {**ROPE_SCALINGS[scaling], "rope_theta": 50_000.0}
    config = transformers.LlamaConfig(**{**SIZES, "max_position_embeddings": 4096, "rope_parameters": params})
    inv_freq, attention = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")
    keys = model_keys(config.to_diff_dict(), "here")  # as save_pretrained writes config.json
    overrides = [f"model.{k}={v}" for k, v in keys.items() if k.startswith("rope") or k in ("d_model", "n_heads")]
    model = build_model(load_config(None, [*overrides, "model.compute_dtype=float32"]).model, nnx.Rngs(0))
    positions = jnp.arange(0, 4096, 7)
    cos, sin = model.rope(positions)
    angles = np.asarray(positions, np.float64)[:, None] * inv_freq.double().numpy()[None]
    np.testing.assert_allclose(cos, np.cos(angles) * attention, atol=2e-4)
    np.testing.assert_allclose(sin, np.sin(angles) * attention, atol=2e-4)


def test_a_multimodal_gemma3s_language_model_imports_and_exports_as_text(tmp_path):
    """Gemma3ForConditionalGeneration keeps its language model under language_model.*, beside a
    vision tower: the language model imports (logits of text equal the multimodal model's), the
    vision tensors stay behind, and the export is that language model as a gemma3_text."""
    torch.manual_seed(0)
    text = {**SIZES, "head_dim": 24, "sliding_window": 8, "sliding_window_pattern": 2}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    config = transformers.Gemma3Config(
        text_config=text, vision_config={**vision, "image_size": 28, "patch_size": 14}, mm_tokens_per_image=4
    )
    model = transformers.Gemma3ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), str(tmp_path / "run")]) == 0
    difference = np.abs(podtrain_logits(tmp_path / "run", TOKENS) - torch_logits(model, TOKENS)).max()
    assert difference < 1e-4, difference

    assert main(["convert", "--to-hf", str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    source, exported = (load_file(tmp_path / d / "model.safetensors") for d in ("hf", "out"))
    language = {
        name.removeprefix("language_model."): t for name, t in source.items() if name.startswith("language_model.")
    }
    assert sorted(exported) == sorted(language)
    assert all(np.array_equal(exported[name], t) for name, t in language.items())
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    assert type(reloaded).__name__ == "Gemma3ForCausalLM"
    assert np.abs(torch_logits(reloaded.float().eval(), TOKENS) - torch_logits(model, TOKENS)).max() < 1e-5
