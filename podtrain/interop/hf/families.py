"""The Hugging Face model_types podtrain's decoder computes (`model.name=llama`, or `moe` for the
expert families), each a record:
the config.json fields it reads, the decoder options it sets, its tensors' names, transformers'
defaults for fields a file may leave out. `config_json.py` reads and writes config.json by these
records. Facts per family: ../shared/MODELS.md and transformers' configuration_*.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from podtrain.errors import ConfigError
from podtrain.interop.hf.tensors import (
    DEEPSEEK_V3_TENSORS,
    GEMMA_TENSORS,
    LLAMA_TENSORS,
    MIXTRAL_TENSORS,
    PHI3_TENSORS,
    QWEN3_MOE_TENSORS,
)

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
    "cache_implementation",
    "initializer_range",
    "_name_or_path",
    "pretraining_tp",  # a Llama 2 training setting that transformers no longer reads
    "output_router_logits",  # whether an MoE returns its router's logits
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
    "attention_dropout",  # must be 0: podtrain has no dropout
}
# The decoder's options a family may set, at the value a family that does not name them computes.
DECODER_DEFAULTS = {
    "attention_bias": "none",
    "qk_norm": False,
    "norm_plus_one": False,
    "scale_embedding": False,
    "post_norms": False,
    "mlp_activation": "silu",
    "query_pre_attn_scalar": 0,
    "attn_softcap": 0.0,
    "final_softcap": 0.0,
    "rope_local_theta": 0.0,
    "rotary_fraction": 1.0,
    "attention_kind": "gqa",
}


@dataclass(frozen=True)
class HfFamily:
    model_type: str
    architecture: str
    fields: frozenset[str]  # config.json fields it reads beyond SHARED
    options: dict  # decoder options it always sets (the rest of DECODER_DEFAULTS at their defaults)
    free: dict  # decoder options config.json decides: option -> its allowed values (None: any)
    windows: str  # which layers slide: "none", "all" (Mistral), "qwen" (max_window_layers), or "pattern" (Gemma)
    defaults: dict  # transformers' values of fields a config.json may leave out
    activation: tuple[str, str] = ("hidden_act", "silu")  # the field naming the MLP's activation, its value
    tensors: dict = field(default_factory=lambda: LLAMA_TENSORS)
    experts: bool = False  # a mixture of experts (model.name=moe)
    known_as: str = ""  # the checkpoints' names on the Hub
    # model key -> the config.json field holding it as it is (a tuple: the first present is read, the last written)
    mapped: dict = field(default_factory=dict)
    written: dict = field(default_factory=dict)  # fields an export writes at these values

    @property
    def model_name(self) -> str:
        """The podtrain family (`model.name`) that computes it."""
        return "moe" if self.experts else "llama"


BIAS = {"attention_bias": ("none", "all")}  # transformers' attention_bias: on q, k, v and the output
QWEN_WINDOWS = frozenset({"sliding_window", "use_sliding_window", "max_window_layers", "layer_types"})
GEMMA_FIELDS = frozenset(
    {
        "attention_bias",
        "hidden_act",  # older Gemma configs name the activation twice; transformers reads hidden_activation
        "query_pre_attn_scalar",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "sliding_window",
        "layer_types",
        "use_bidirectional_attention",
    }
)
GEMMA_OPTIONS = {"norm_plus_one": True, "scale_embedding": True, "post_norms": True, "mlp_activation": "gelu_tanh"}
GEMMA_FREE = {**BIAS, "query_pre_attn_scalar": None, "attn_softcap": None, "final_softcap": None}
GEMMA_DEFAULTS = {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096, "tie_word_embeddings": True}
GELU = ("hidden_activation", "gelu_pytorch_tanh")
EXPERTS = {"experts_per_token": "num_experts_per_tok", "router_aux_loss_coef": "router_aux_loss_coef"}
DEEPSEEK_V3 = {  # transformers' DeepseekV3Config
    "experts": "n_routed_experts",
    "expert_d_ff": "moe_intermediate_size",
    "router_renormalize": "norm_topk_prob",
    "router_groups": "n_group",
    "router_topk_groups": "topk_group",
    "routed_scale": "routed_scaling_factor",
    "shared_experts": "n_shared_experts",
    "first_dense_layers": "first_k_dense_replace",
    **{k: k for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")},
    "rope_interleave": "rope_interleave",
    "experts_per_token": "num_experts_per_tok",
}
DEEPSEEK_V3_DEFAULTS = {
    **{"n_routed_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "norm_topk_prob": True},
    **{"n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "n_shared_experts": 1, "first_k_dense_replace": 3},
    **{"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128},
    **{"rope_interleave": True, "num_nextn_predict_layers": 1},
}

FAMILIES = {
    f.model_type: f
    for f in (
        HfFamily(
            "llama",
            "LlamaForCausalLM",
            frozenset({"attention_bias", "mlp_bias"}),
            {},
            BIAS,
            "none",
            {},
            known_as="Llama, SmolLM, TinyLlama",
        ),
        HfFamily(
            "mistral",
            "MistralForCausalLM",
            frozenset({"sliding_window"}),
            {},
            {},
            "all",
            {"sliding_window": 4096},
            known_as="Mistral",
        ),
        HfFamily(
            "qwen2", "Qwen2ForCausalLM", QWEN_WINDOWS, {"attention_bias": "qkv"}, {}, "qwen", {}, known_as="Qwen2/2.5"
        ),
        HfFamily(
            "qwen3",
            "Qwen3ForCausalLM",
            QWEN_WINDOWS | {"attention_bias"},
            {"qk_norm": True},
            BIAS,
            "qwen",
            {"head_dim": 128},
            known_as="Qwen3",
        ),
        HfFamily(
            "gemma2",
            "Gemma2ForCausalLM",
            GEMMA_FIELDS,
            GEMMA_OPTIONS,
            GEMMA_FREE,
            "pattern",
            {
                **GEMMA_DEFAULTS,
                "attn_logit_softcapping": 50.0,
                "final_logit_softcapping": 30.0,
                "sliding_window_pattern": 2,
            },
            GELU,
            GEMMA_TENSORS,
            known_as="Gemma 2",
        ),
        HfFamily(
            "gemma3_text",
            "Gemma3ForCausalLM",
            GEMMA_FIELDS | {"rope_local_base_freq", "sliding_window_pattern", "_sliding_window_pattern"},
            {**GEMMA_OPTIONS, "qk_norm": True},
            {**GEMMA_FREE, "rope_local_theta": None},
            "pattern",
            {
                **GEMMA_DEFAULTS,
                "rope_theta": 1_000_000.0,
                "rope_local_base_freq": 10_000.0,
                "sliding_window_pattern": 6,
            },
            GELU,
            GEMMA_TENSORS,
            known_as="Gemma 3",
        ),
        HfFamily(
            "mixtral",
            "MixtralForCausalLM",
            frozenset({"sliding_window", "num_local_experts", "num_experts_per_tok"})
            | {"router_aux_loss_coef", "router_jitter_noise"},
            {},
            {},
            "all",
            {"num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001},
            tensors=MIXTRAL_TENSORS,
            experts=True,
            known_as="Mixtral",
            # each expert's width is intermediate_size; Mixtral always renormalises
            mapped={**EXPERTS, "experts": "num_local_experts", "expert_d_ff": "intermediate_size"},
        ),
        HfFamily(
            "qwen3_moe",
            "Qwen3MoeForCausalLM",
            QWEN_WINDOWS
            | {"attention_bias", "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size"}
            | {"norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef"},
            {"qk_norm": True},
            BIAS,
            "qwen",
            {
                "head_dim": 128,
                "num_experts": 128,
                "num_experts_per_tok": 8,
                "moe_intermediate_size": 768,
                "norm_topk_prob": False,
                "router_aux_loss_coef": 0.001,
            },
            tensors=QWEN3_MOE_TENSORS,
            experts=True,
            known_as="Qwen3-MoE",
            mapped={  # transformers 5 writes num_local_experts too, where the Hub's files say num_experts
                **EXPERTS,
                "experts": ("num_local_experts", "num_experts"),
                "expert_d_ff": "moe_intermediate_size",
                "router_renormalize": "norm_topk_prob",
            },
            written={"decoder_sparse_step": 1, "mlp_only_layers": []},
        ),
        HfFamily(
            "deepseek_v3",
            "DeepseekV3ForCausalLM",
            # head_dim and qk_head_dim are transformers' own sums of the head sizes; the multi-token
            # prediction layers (num_nextn_predict_layers) are not computed, as in transformers
            frozenset(DEEPSEEK_V3.values()) | {"attention_bias", "head_dim", "qk_head_dim", "num_nextn_predict_layers"},
            {"attention_kind": "mla", "router": "sigmoid"},
            BIAS,
            "none",
            DEEPSEEK_V3_DEFAULTS,
            tensors=DEEPSEEK_V3_TENSORS,
            experts=True,
            known_as="DeepSeek-V3, DeepSeek-V2-Lite's shape",
            mapped=DEEPSEEK_V3,
            written={"num_nextn_predict_layers": 0},
        ),
        HfFamily(
            "phi3",
            "Phi3ForCausalLM",
            # original_max_position_embeddings only matters to longrope scaling, which is refused
            frozenset({"sliding_window", "resid_pdrop", "embd_pdrop", "partial_rotary_factor"})
            | {"original_max_position_embeddings"},
            {},
            {"rotary_fraction": None},
            "all",
            {},
            tensors=PHI3_TENSORS,
            known_as="Phi-3",
        ),
    )
}


# A multimodal Gemma 3 (Gemma3ForConditionalGeneration): its language model is a gemma3_text under
# these prefixes; the vision tower and projector beside it are not imported.
MULTIMODAL = {
    "gemma3": {
        "text_type": "gemma3_text",  # its text_config's model_type, which older files leave out
        "prefixes": {"model.": "language_model.model.", "lm_head.": "language_model.lm_head."},
        "elsewhere": ("vision_tower.", "multi_modal_projector."),
        "fields": {"text_config", "vision_config", "boi_token_index", "eoi_token_index", "image_token_index"}
        | {"mm_tokens_per_image", "tie_word_embeddings"},
    }
}


def text_config(hf: dict, where: str) -> dict:
    """The language model's config.json fields: the file's own, or a multimodal one's text_config."""
    if hf.get("model_type") not in MULTIMODAL:
        return hf
    unknown = sorted(set(hf) - INERT - MULTIMODAL[hf["model_type"]]["fields"])
    if unknown:
        raise ConfigError(f"{where}: config.json has {', '.join(unknown)}, which podtrain does not read; refused.")
    text = {"model_type": MULTIMODAL[hf["model_type"]]["text_type"], **hf["text_config"]}
    if hf.get("tie_word_embeddings", text.get("tie_word_embeddings")) != text.get("tie_word_embeddings"):
        raise ConfigError(f"{where}: config.json ties the embeddings otherwise than its text_config; refused.")
    return text


def tensor_layout(hf: dict) -> tuple[dict, tuple[str, ...]]:
    """(podtrain param -> (tensor name, storage), prefixes of tensors that are not the language model's)
    of a checkpoint with this config.json."""
    if hf.get("model_type") not in MULTIMODAL:  # past the last layer: DeepSeek-V3's multi-token prediction, unread
        layers, extra = hf.get("num_hidden_layers", 0), hf.get("num_nextn_predict_layers") or 0
        return family_of(hf, "").tensors, tuple(f"model.layers.{layers + j}." for j in range(extra))
    layout = MULTIMODAL[hf["model_type"]]
    table = family_of(text_config(hf, ""), "").tensors

    def moved(name: str) -> str:
        prefix = next(p for p in layout["prefixes"] if name.startswith(p))
        return layout["prefixes"][prefix] + name.removeprefix(prefix)

    return {path: (moved(name), storage) for path, (name, storage) in table.items()}, layout["elsewhere"]


def model_types(model_name: str) -> tuple[str, ...]:
    """The model_types podtrain family `model_name` computes: its `model.hf_type` choices."""
    return tuple(kind for kind, family in FAMILIES.items() if family.model_name == model_name)


def known_as() -> str:
    """Every family's checkpoints by their names on the Hub: 'Llama, SmolLM, ..., Phi-3'."""
    return ", ".join(f.known_as for f in FAMILIES.values())


def family_of(hf: dict, where: str) -> HfFamily:
    kind = hf.get("model_type")
    if kind not in FAMILIES:
        kind = kind or (hf.get("architectures") or ["an unknown architecture"])[0]
        raise ConfigError(
            f"{where} holds a `{kind}` model; podtrain converts model_type {', '.join(FAMILIES)} "
            f"({known_as()}) and the language model of a multimodal "
            f"{', '.join(MULTIMODAL)}."
        )
    return FAMILIES[kind]
