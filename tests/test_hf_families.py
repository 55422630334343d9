"""The Hugging Face families beyond Llama as options of podtrain's decoder: each model_type built
at random by transformers with its own options on (GQA, an explicit head_dim, windows shorter
than the sequence, biases and q/k norms away from their initial values), imported, compared
logit for logit and token for token with transformers, and exported back bit for bit."""

import json

import numpy as np
import pytest
from podtrain.cli import main
from podtrain.train.run import Run
from podtrain.train.tasks.sampling import cached_tokens
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
    # layer 0 attends to everything, layer 1 slides (max_window_layers)
    "qwen2": ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
    "qwen3": (
        "qwen3",
        {"head_dim": 24, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    ),
    "qwen3-untied-biases": ("qwen3", {"attention_bias": True, "tie_word_embeddings": False}),
}


def hf_model(folder, model_type, options, seed=0):
    """A random model of `model_type` saved as safetensors in `folder`, in float32, eager attention."""
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(model_type, **SIZES, **options)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():  # norms start at one and biases at zero; random ones test their mapping
        for name, p in model.named_parameters():
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
    difference = np.abs(podtrain_logits(tmp_path / "run", TOKENS) - torch_logits(model, TOKENS)).max()
    assert difference < 1e-4, difference

    prompt = TOKENS[0, :7]
    with torch.no_grad():
        theirs = model.generate(torch.from_numpy(prompt[None]), max_new_tokens=16, do_sample=False, min_new_tokens=0)
    cfg, fns, params = Run.at(tmp_path / "run").language_model()
    assert cached_tokens(fns, params, list(prompt), 16, 0.0, cfg.model.max_seq_len, seed=0) == theirs[0, 7:].tolist()

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
