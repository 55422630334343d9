"""config.json of a Hugging Face checkpoint as podtrain's model keys, and back, by the records of
`families.py`.

Every field is read, known not to change what the model computes (token ids, dtype, cache), or
refused by name: a field this module does not know may change the computation, so it is never
dropped silently.
"""

from __future__ import annotations

import math

from podtrain.errors import ConfigError
from podtrain.interop.hf.families import DECODER_DEFAULTS, FAMILIES, INERT, SHARED, HfFamily, family_of, text_config

# Each model.rope_scaling but none: its model.rope_* keys -> the config.json rope_scaling fields holding them.
ROPE_SCALINGS = {
    "llama3": {
        "rope_factor": "factor",
        "rope_low_freq_factor": "low_freq_factor",
        "rope_high_freq_factor": "high_freq_factor",
        "rope_original_max_len": "original_max_position_embeddings",
    },
    "linear": {"rope_factor": "factor"},
    "yarn": {  # read by _yarn, which knows transformers' defaults
        "rope_factor": "factor",
        "rope_original_max_len": "original_max_position_embeddings",
        "rope_beta_fast": "beta_fast",
        "rope_beta_slow": "beta_slow",
        "rope_truncate": "truncate",
        "rope_attention_factor": "attention_factor",
        "rope_mscale_all_dim": "mscale_all_dim",  # DeepSeek's latent attention scales its scores by it
    },
}

# Model keys that decide the params' shapes or what they compute: a checkpoint loads only into equal ones.
STRUCTURE_KEYS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "tie_embeddings", "head_dim")
STRUCTURE_KEYS += tuple(DECODER_DEFAULTS)
# An MoE's: its experts, how many a token takes and how their weights are normalised; latent attention's sizes.
MAPPED_KEYS = ("experts", "experts_per_token", "expert_d_ff", "router_renormalize", "shared_experts")
MAPPED_KEYS += ("first_dense_layers", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim")
MAPPED_KEYS += ("v_head_dim", "rope_interleave")
NULL = {"q_lora_rank": 0}  # model keys whose value here is config.json's null (DeepSeek: no query rank)
# The routing options of podtrain's MoE a Hugging Face MoE family computes only at these values.
ROUTING_DEFAULTS = {
    "router": "softmax",
    "router_groups": 1,
    "router_topk_groups": 1,
    "routed_scale": 1.0,
    "shared_experts": 0,
    "first_dense_layers": 0,
    "router_bias_update_rate": 0.0,
}


# Which layers slide when config.json has no layer_types, by the family's kind of windows; "pattern": all
# but every period-th (Gemma 2: 2, Gemma 3: 6; transformers 5 writes _sliding_window_pattern).
SLIDES_BY_DEFAULT = {
    "all": lambda hf, n: [True] * n,
    "qwen": lambda hf, n: [i >= hf.get("max_window_layers", n) for i in range(n)],
    "pattern": lambda hf, n: [
        (i + 1) % hf.get("_sliding_window_pattern", hf["sliding_window_pattern"]) != 0 for i in range(n)
    ],
    "none": lambda hf, n: [False] * n,
}
SLIDING, FULL = "sliding_attention", "full_attention"  # layer_types' words


def _windows(hf: dict, family: HfFamily, n_layers: int) -> dict:
    """model.sliding_window and model.full_attention_layers, as transformers decides which layers slide."""
    window = hf.get("sliding_window") if family.windows != "none" else None
    if family.windows == "qwen" and not hf.get("use_sliding_window"):
        window = None
    types = hf.get("layer_types") if family.windows in ("qwen", "pattern") else None
    sliding = [t == SLIDING for t in types] if types else SLIDES_BY_DEFAULT[family.windows](hf, n_layers)
    if not window or not any(sliding):
        return {"sliding_window": 0, "full_attention_layers": []}
    return {"sliding_window": window, "full_attention_layers": [i for i, s in enumerate(sliding) if not s]}


def _rope(hf: dict, where: str) -> dict:
    """rope_theta, rope_scaling (and its parameters) and rope_local_theta of a config.json, in either
    the rope_theta/rope_scaling form or transformers 5's rope_parameters (per layer type for Gemma 3)."""
    params = hf.get("rope_parameters") or {
        **(hf.get("rope_scaling") or {}),
        "rope_theta": hf.get("rope_theta", 10000.0),
    }
    fraction = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    keys = {"rope_local_theta": 0.0, "rotary_fraction": float(fraction)}
    if "full_attention" in params:  # one set per layer type
        keys["rope_local_theta"] = float(params.get("sliding_attention", {}).get("rope_theta", 0.0))
        params = params["full_attention"]
    elif "rope_local_base_freq" in hf:
        keys["rope_local_theta"] = float(hf["rope_local_base_freq"])
    kind = params.get("rope_type", params.get("type", "default"))
    keys |= {"rope_theta": float(params.get("rope_theta", hf.get("rope_theta", 10000.0))), "rope_scaling": "none"}
    if kind == "yarn":
        keys |= {"rope_scaling": kind, **_yarn(hf, params)}
    elif kind in ROPE_SCALINGS:
        keys |= {"rope_scaling": kind, **{ours: params[theirs] for ours, theirs in ROPE_SCALINGS[kind].items()}}
    elif kind != "default":
        raise ConfigError(
            f"{where}: config.json asks for rope scaling `{kind}`; podtrain computes the default rotary "
            f"embedding and {', '.join(f'`{k}`' for k in ROPE_SCALINGS)}."
        )
    return keys


def _yarn(hf: dict, params: dict) -> dict:
    """YaRN's parameters as transformers reads them: the original context from the parameters,
    else the config, else max_position_embeddings; the factor, else their ratio; the attention
    factor given, else from mscale / mscale_all_dim (DeepSeek-V3), else YaRN's default (0)."""
    original = (
        params.get("original_max_position_embeddings")
        or hf.get("original_max_position_embeddings")
        or hf["max_position_embeddings"]
    )
    factor = params.get("factor") or hf["max_position_embeddings"] / original
    attention = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention is None and mscale and mscale_all_dim and factor > 1:
        attention = (0.1 * mscale * math.log(factor) + 1) / (0.1 * mscale_all_dim * math.log(factor) + 1)
    return {
        "rope_factor": float(factor),
        "rope_original_max_len": int(original),
        "rope_beta_fast": float(params.get("beta_fast") or 32),
        "rope_beta_slow": float(params.get("beta_slow") or 1),
        "rope_attention_factor": float(attention or 0.0),
        "rope_truncate": bool(params.get("truncate", True)),
        "rope_mscale_all_dim": float(mscale_all_dim or 0.0),
    }


def model_keys(hf: dict, where: str) -> dict:
    """The `model.*` keys of podtrain's decoder for a transformers config (config.json), refusing
    any field it does not compute, by name."""
    hf = text_config(hf, where)
    family = family_of(hf, where)
    unknown = sorted(set(hf) - INERT - SHARED - family.fields - {family.activation[0]})
    if unknown:
        raise ConfigError(
            f"{where}: config.json has {', '.join(unknown)}, which podtrain does not read for model_type "
            f"{family.model_type}; it may change what the model computes, so the checkpoint is refused."
        )
    _refuse_other_values(hf, family, where)
    hf = {**family.defaults, **hf}
    d_model, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    read = {  # the free options, as config.json gives them
        "attention_bias": "all" if hf.get("attention_bias") else "none",
        "query_pre_attn_scalar": int(hf.get("query_pre_attn_scalar") or 0),
        "attn_softcap": float(hf.get("attn_logit_softcapping") or 0.0),
        "final_softcap": float(hf.get("final_logit_softcapping") or 0.0),
    }
    rope = _rope(hf, where)
    in_rope = {option: rope.pop(option) for option in ("rope_local_theta", "rotary_fraction")}
    read |= in_rope
    for option, value in in_rope.items():  # rope_parameters may hold them for any family
        if option not in family.free and value != DECODER_DEFAULTS[option]:
            raise ConfigError(
                f"{where}: config.json asks for {option}={value!r} (podtrain's model.{option}), which model_type "
                f"{family.model_type} does not compute; refused."
            )
    keys = {
        "name": family.model_name,
        "hf_type": family.model_type,
        "vocab_size": hf["vocab_size"],
        "d_model": d_model,
        "n_layers": hf["num_hidden_layers"],
        "n_heads": n_heads,
        "n_kv_heads": hf.get("num_key_value_heads") or n_heads,
        "head_dim": hf.get("head_dim") or d_model // n_heads,
        "d_ff": hf["intermediate_size"],
        "norm_eps": hf.get("rms_norm_eps", 1e-6),
        "max_seq_len": hf.get("max_position_embeddings", 2048),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        **DECODER_DEFAULTS,
        **family.options,
        **{option: read[option] for option in family.free},
        **rope,
        **_windows(hf, family, hf["num_hidden_layers"]),
        **_mapped(hf, family, where),
    }
    return keys


def _refuse_other_values(hf: dict, family: HfFamily, where: str) -> None:
    """A field podtrain computes at one value only, at another, is refused by name."""
    activation = (family.activation[1],)
    accepted = {  # fields podtrain computes at these values only
        family.activation[0]: activation,
        "hidden_act": activation,
        "attention_dropout": (0.0,),  # podtrain has no dropout
        "resid_pdrop": (0.0,),
        "embd_pdrop": (0.0,),
        "mlp_bias": (False,),
        "use_bidirectional_attention": (None, False),
        "router_jitter_noise": (0.0, None),  # a training-time perturbation of the router podtrain does not make
        "decoder_sparse_step": (1,),  # every layer an MoE layer
        "mlp_only_layers": ([],),
    }
    for name, values in accepted.items():
        if name in hf and hf[name] not in values:
            raise ConfigError(
                f"{where}: config.json has {name}={hf[name]!r}; podtrain computes {name}={values[0]!r} only, so this "
                "checkpoint cannot be converted."
            )


def _mapped(hf: dict, family: HfFamily, where: str) -> dict:
    """The model keys `family` keeps in config.json fields as they are (an MoE's experts, latent
    attention's sizes), from the first of each key's fields that the file has."""
    keys = {}
    for ours, theirs in family.mapped.items():
        names = theirs if isinstance(theirs, tuple) else (theirs,)
        if not (present := [name for name in names if name in hf]):
            raise ConfigError(f"{where}: config.json has no {' or '.join(names)}; a {family.model_type} needs it.")
        value = hf[present[0]]
        keys[ours] = NULL[ours] if value is None and ours in NULL else value
    return keys


def _misfits(family: HfFamily, model) -> list[str]:
    """The options of podtrain's decoder config `model` that `family` has no place for."""
    found = []
    for option, default in DECODER_DEFAULTS.items():
        value, allowed = getattr(model, option), family.free.get(option, ())
        if option in family.free and (allowed is None or value in allowed):
            continue
        if value != family.options.get(option, default):
            found.append(f"model.{option}={str(value).lower() if isinstance(value, bool) else value}")
    if model.sliding_window and family.windows == "none":
        found.append("a sliding window")
    if model.sliding_window and family.windows == "all" and model.full_attention_layers:
        found.append("sliding windows on some layers only")
    if family.model_name != model.name:
        found.append(f"model.name={model.name}")
    elif family.experts:  # a routing option the family neither maps nor computes at the model's value
        computed = {**ROUTING_DEFAULTS, "router_renormalize": True, **family.options}
        biased = "layers/mlp/router_bias" in family.tensors  # a bias the router's update moves has a place
        for k in [*ROUTING_DEFAULTS, "router_renormalize"]:
            free = k in family.mapped or (k == "router_bias_update_rate" and biased)
            if not free and getattr(model, k) != computed[k]:
                found.append(f"model.{k}={str(getattr(model, k)).lower()}")
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


def hf_config(model, token_ids: dict, dtype: str) -> dict:
    """config.json of `model.hf_type` for podtrain's decoder config `model` with `token_ids` (bos, eos
    and pad: an id, a list of eos ids, or None); the rotary settings in the rope_theta/rope_scaling
    form that transformers 4 and 5 both read."""
    family = export_family(model)
    config = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": model.vocab_size,
        "hidden_size": model.d_model,
        "num_hidden_layers": model.n_layers,
        "num_attention_heads": model.n_heads,
        "num_key_value_heads": model.n_heads if model.attention_kind == "mla" else model.n_kv_heads,
        "head_dim": model.head_size,
        "intermediate_size": model.d_ff,
        "rms_norm_eps": model.norm_eps,
        "rope_theta": model.rope_theta,
        "rope_scaling": _rope_scaling(model),
        "max_position_embeddings": model.max_seq_len,
        "tie_word_embeddings": model.tie_embeddings,
        "bos_token_id": token_ids.get("bos_token_id"),
        "eos_token_id": token_ids.get("eos_token_id"),
        "pad_token_id": token_ids.get("pad_token_id"),  # None, not a family's default outside this vocabulary
        "torch_dtype": dtype,
        family.activation[0]: family.activation[1],
    }
    return config | _options_out(family, model) | _mapped_out(family, model) | _windows_out(family, model)


def _rope_scaling(model) -> dict | None:
    """config.json's rope_scaling of podtrain's model.rope_scaling and its keys."""
    if model.rope_scaling == "none":
        return None
    fields = {theirs: getattr(model, ours) for ours, theirs in ROPE_SCALINGS[model.rope_scaling].items()}
    for name in ("attention_factor", "mscale_all_dim"):  # at their defaults, a file leaves them out
        if fields.get(name) == 0:
            del fields[name]
    return {"rope_type": model.rope_scaling, **fields}


def _options_out(family: HfFamily, model) -> dict:
    """The fields of the decoder's options that `family` writes."""
    config = {}
    if "attention_bias" in family.fields:
        config["attention_bias"] = model.attention_bias == "all"
    if "mlp_bias" in family.fields:
        config["mlp_bias"] = False
    if "query_pre_attn_scalar" in family.free:
        config |= {
            "query_pre_attn_scalar": model.query_pre_attn_scalar or model.head_size,
            "attn_logit_softcapping": model.attn_softcap or None,
            "final_logit_softcapping": model.final_softcap or None,
        }
    if "rope_local_theta" in family.free:
        config["rope_local_base_freq"] = model.rope_local_theta or model.rope_theta
    if "rotary_fraction" in family.free:
        config["partial_rotary_factor"] = model.rotary_fraction
    return config


def _mapped_out(family: HfFamily, model) -> dict:
    """The fields of the model keys `family` maps, and those it writes at fixed values."""
    config = dict(family.written)
    for ours, theirs in family.mapped.items():
        value = getattr(model, "expert_width" if ours == "expert_d_ff" else ours)  # expert_d_ff 0: d_ff
        if ours in NULL and value == NULL[ours]:
            value = None
        config[theirs[-1] if isinstance(theirs, tuple) else theirs] = value
    return config


def _windows_out(family: HfFamily, model) -> dict:
    """The sliding-window fields in the form `family` writes them (the reverse of `_windows`)."""
    if family.windows == "none":
        return {}
    config = {"sliding_window": model.sliding_window or None}
    if family.windows == "qwen":  # max_window_layers unread: layer_types says which layers slide
        config |= {"use_sliding_window": model.sliding_window > 0, "max_window_layers": model.n_layers}
    if family.windows in ("qwen", "pattern"):
        windows = model.layer_windows() or [0] * model.n_layers
        config["layer_types"] = [SLIDING if w else FULL for w in windows]
    return config


def shape_differences(keys: dict, model) -> list[str]:
    """The structure keys in which an HF config's keys and a podtrain model config differ."""
    return [
        f"model.{k} ({keys[k]} there, {getattr(model, k)} here)"
        for k in STRUCTURE_KEYS + MAPPED_KEYS
        if k in keys and keys[k] != getattr(model, k) and not (k == "head_dim" and keys[k] == model.head_size)
    ]
