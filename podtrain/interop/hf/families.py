"""The Hugging Face model_types podtrain's decoder (`model.name=llama`) computes, each a record of
the options it sets: config.json as podtrain's model keys and back, and its tensors' names.

Every field of config.json is read, known not to change what the model computes (token ids,
dtype, cache), or refused by name: a field this module does not know may change the computation,
so it is never dropped silently. Facts per family: ../shared/MODELS.md and transformers'
configuration_*.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from podtrain.errors import ConfigError
from podtrain.interop.hf.checkpoint import AS_IS, FLAT

# podtrain parameter -> (Hugging Face tensor, how it is stored: checkpoint.py). {i} is the layer.
LLAMA_TENSORS = {
    "embed": ("model.embed_tokens.weight", AS_IS),
    "head": ("lm_head.weight", 1),
    "norm/scale": ("model.norm.weight", FLAT),
    "layers/attn/wq": ("model.layers.{i}.self_attn.q_proj.weight", 1),
    "layers/attn/wk": ("model.layers.{i}.self_attn.k_proj.weight", 1),
    "layers/attn/wv": ("model.layers.{i}.self_attn.v_proj.weight", 1),
    "layers/attn/wo": ("model.layers.{i}.self_attn.o_proj.weight", 2),
    "layers/attn/bq": ("model.layers.{i}.self_attn.q_proj.bias", FLAT),
    "layers/attn/bk": ("model.layers.{i}.self_attn.k_proj.bias", FLAT),
    "layers/attn/bv": ("model.layers.{i}.self_attn.v_proj.bias", FLAT),
    "layers/attn/bo": ("model.layers.{i}.self_attn.o_proj.bias", FLAT),
    "layers/attn/q_norm/scale": ("model.layers.{i}.self_attn.q_norm.weight", FLAT),
    "layers/attn/k_norm/scale": ("model.layers.{i}.self_attn.k_norm.weight", FLAT),
    "layers/attn_norm/scale": ("model.layers.{i}.input_layernorm.weight", FLAT),
    "layers/mlp/w_gate": ("model.layers.{i}.mlp.gate_proj.weight", 1),
    "layers/mlp/w_up": ("model.layers.{i}.mlp.up_proj.weight", 1),
    "layers/mlp/w_down": ("model.layers.{i}.mlp.down_proj.weight", 1),
    "layers/mlp_norm/scale": ("model.layers.{i}.post_attention_layernorm.weight", FLAT),
}

# Fields that do not change what the model computes from tokens.
INERT = {
    "architectures",
    "model_type",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "use_cache",
    "initializer_range",
    "_name_or_path",
    "pretraining_tp",  # a Llama 2 training setting that transformers no longer reads
}
# Fields every family reads.
SHARED = {
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
}
# Fields whose only value podtrain computes: the MLP's activation; no dropout (a training regulariser podtrain lacks).
FIXED = {"hidden_act": "silu", "attention_dropout": 0.0, "mlp_bias": False}
ROPE_SCALING_KEYS = {
    "rope_factor": "factor",
    "rope_low_freq_factor": "low_freq_factor",
    "rope_high_freq_factor": "high_freq_factor",
    "rope_original_max_len": "original_max_position_embeddings",
}
# Model keys that decide the params' shapes or what they compute: a checkpoint loads only into equal ones.
STRUCTURE_KEYS = (
    "vocab_size",
    "d_model",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "d_ff",
    "tie_embeddings",
    "head_dim",
    "attention_bias",
    "qk_norm",
)


@dataclass(frozen=True)
class HfFamily:
    model_type: str
    architecture: str
    fields: frozenset[str]  # config.json fields it reads beyond SHARED
    attention_bias: tuple[str, ...]  # the values of model.attention_bias it can hold
    qk_norm: bool
    windows: str  # "none", "all" (every layer slides: Mistral) or "layers" (layer_types: Qwen)
    tensors: dict = field(default_factory=lambda: LLAMA_TENSORS)


FAMILIES = {
    f.model_type: f
    for f in (
        HfFamily(
            "llama", "LlamaForCausalLM", frozenset({"attention_bias", "mlp_bias"}), ("none", "all"), False, "none"
        ),
        HfFamily("mistral", "MistralForCausalLM", frozenset({"sliding_window"}), ("none",), False, "all"),
        HfFamily(
            "qwen2",
            "Qwen2ForCausalLM",
            frozenset({"sliding_window", "use_sliding_window", "max_window_layers", "layer_types"}),
            ("qkv",),
            False,
            "layers",
        ),
        HfFamily(
            "qwen3",
            "Qwen3ForCausalLM",
            frozenset({"attention_bias", "sliding_window", "use_sliding_window", "max_window_layers", "layer_types"}),
            ("none", "all"),
            True,
            "layers",
        ),
    )
}


def family_of(hf: dict, where: str) -> HfFamily:
    kind = hf.get("model_type")
    if kind not in FAMILIES:
        kind = kind or (hf.get("architectures") or ["an unknown architecture"])[0]
        raise ConfigError(
            f"{where} holds a `{kind}` model; podtrain converts model_type {', '.join(FAMILIES)} (Llama, SmolLM, "
            "TinyLlama, Mistral, Qwen2/2.5, Qwen3)."
        )
    return FAMILIES[kind]


def _windows(hf: dict, family: HfFamily, n_layers: int) -> dict:
    """model.sliding_window and model.full_attention_layers, as transformers decides which layers slide."""
    if family.windows == "all":
        window, sliding = hf.get("sliding_window"), [True] * n_layers
    elif family.windows == "layers":
        window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
        first = hf.get("max_window_layers", n_layers)
        types = hf.get("layer_types") or [
            "sliding_attention" if i >= first else "full_attention" for i in range(n_layers)
        ]
        sliding = [t == "sliding_attention" for t in types]
    else:
        window, sliding = None, [False] * n_layers
    if not window or not any(sliding):
        return {"sliding_window": 0, "full_attention_layers": []}
    return {"sliding_window": window, "full_attention_layers": [i for i, s in enumerate(sliding) if not s]}


def model_keys(hf: dict, where: str) -> dict:
    """The `model.*` keys of podtrain's decoder for a transformers config (config.json), refusing
    any field it does not compute, by name."""
    family = family_of(hf, where)
    unknown = sorted(set(hf) - INERT - SHARED - family.fields - set(FIXED))
    if unknown:
        raise ConfigError(
            f"{where}: config.json has {', '.join(unknown)}, which podtrain does not read for model_type "
            f"{family.model_type}; it may change what the model computes, so the checkpoint is refused."
        )
    for key, value in FIXED.items():
        if hf.get(key, value) != value:
            raise ConfigError(
                f"{where}: config.json has {key}={hf[key]!r}; podtrain computes {key}={value!r} only, so this "
                "checkpoint cannot be converted."
            )
    d_model, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    # transformers >= 5 writes rope_parameters; earlier versions rope_theta and rope_scaling
    rope = hf.get("rope_parameters") or {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 10000.0)}
    kind = rope.get("rope_type", rope.get("type", "default"))
    bias = "qkv" if family.attention_bias == ("qkv",) else "all" if hf.get("attention_bias") else "none"
    keys = {
        "name": "llama",
        "hf_type": family.model_type,
        "vocab_size": hf["vocab_size"],
        "d_model": d_model,
        "n_layers": hf["num_hidden_layers"],
        "n_heads": n_heads,
        "n_kv_heads": hf.get("num_key_value_heads") or n_heads,
        "head_dim": hf.get("head_dim") or d_model // n_heads,
        "d_ff": hf["intermediate_size"],
        "norm_eps": hf.get("rms_norm_eps", 1e-6),
        "rope_theta": float(rope.get("rope_theta", 10000.0)),
        "max_seq_len": hf.get("max_position_embeddings", 2048),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "attention_bias": bias,
        "qk_norm": family.qk_norm,
        "rope_scaling": "none",
        **_windows(hf, family, hf["num_hidden_layers"]),
    }
    if kind == "llama3":
        keys |= {"rope_scaling": kind, **{ours: rope[theirs] for ours, theirs in ROPE_SCALING_KEYS.items()}}
    elif kind != "default":
        raise ConfigError(
            f"{where}: config.json asks for rope scaling `{kind}`; podtrain computes the default rotary "
            "embedding and Llama 3's (`llama3`)."
        )
    return keys


def _misfits(family: HfFamily, model) -> list[str]:
    """The options of podtrain's decoder config `model` that `family` has no place for."""
    found = []
    if model.attention_bias not in family.attention_bias:
        found.append(f"model.attention_bias={model.attention_bias} (it has {' or '.join(family.attention_bias)})")
    if model.qk_norm != family.qk_norm:
        found.append(f"model.qk_norm={str(model.qk_norm).lower()}")
    if model.sliding_window and family.windows == "none":
        found.append("a sliding window")
    if model.sliding_window and family.windows == "all" and model.full_attention_layers:
        found.append("sliding windows on some layers only")
    return found


def export_family(model) -> HfFamily:
    """The family `model.hf_type` names, if it can hold the model's options; else a clear error."""
    family = FAMILIES[model.hf_type]
    if misfits := _misfits(family, model):
        fits = [f.model_type for f in FAMILIES.values() if not _misfits(f, model)]
        advice = f"set model.hf_type={' or '.join(fits)}" if fits else "no Hugging Face family computes this model"
        raise ConfigError(
            f"model_type {family.model_type} (model.hf_type) has no place for {', '.join(misfits)}; {advice}."
        )
    return family


def hf_config(model, eos_id: int | None, dtype: str) -> dict:
    """config.json of `model.hf_type` for podtrain's decoder config `model`; the rotary settings in
    the rope_theta/rope_scaling form that transformers 4 and 5 both read."""
    family = export_family(model)
    scaling = (
        {
            "rope_type": model.rope_scaling,
            **{theirs: getattr(model, ours) for ours, theirs in ROPE_SCALING_KEYS.items()},
        }
        if model.rope_scaling != "none"
        else None
    )
    config = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": model.vocab_size,
        "hidden_size": model.d_model,
        "num_hidden_layers": model.n_layers,
        "num_attention_heads": model.n_heads,
        "num_key_value_heads": model.n_kv_heads,
        "head_dim": model.head_size,
        "intermediate_size": model.d_ff,
        "rms_norm_eps": model.norm_eps,
        "rope_theta": model.rope_theta,
        "rope_scaling": scaling,
        "max_position_embeddings": model.max_seq_len,
        "tie_word_embeddings": model.tie_embeddings,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "torch_dtype": dtype,
        "hidden_act": "silu",
    }
    if "attention_bias" in family.fields:
        config["attention_bias"] = model.attention_bias == "all"
    if "mlp_bias" in family.fields:
        config["mlp_bias"] = False
    windows = model.layer_windows()
    if family.windows == "all":
        config["sliding_window"] = model.sliding_window or None
    elif family.windows == "layers":
        config |= {
            "use_sliding_window": windows is not None,
            "sliding_window": model.sliding_window or None,
            "max_window_layers": model.n_layers,  # unread: layer_types says which layers slide
            "layer_types": ["sliding_attention" if w else "full_attention" for w in windows or [0] * model.n_layers],
        }
    return config


def shape_differences(keys: dict, model) -> list[str]:
    """The structure keys in which an HF config's keys and a podtrain model config differ."""
    return [
        f"model.{k} ({keys[k]} there, {getattr(model, k)} here)"
        for k in STRUCTURE_KEYS
        if keys[k] != getattr(model, k) and not (k == "head_dim" and keys[k] == model.head_size)
    ]
