"""The Hugging Face model_types podtrain's decoder computes (`model.name=llama`, or `moe` for the
expert families), each a record:
the config.json fields it reads, the decoder options it sets, its tensors' names, transformers'
defaults for fields a file may leave out. `config_json.py` reads and writes config.json by these
records. Facts per family: ../shared/MODELS.md and transformers' configuration_*.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from podtrain.errors import ConfigError
from podtrain.interop.hf.checkpoint import AS_IS, FLAT

# podtrain parameter -> (Hugging Face tensor, how it is stored: checkpoint.py). {i} is the layer;
# a parameter the model does not have (a bias, a q/k norm) is simply not read or written.
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

GEMMA_TENSORS = {  # Gemma's four norms a layer: its post_attention_layernorm is the attention output's
    **{k: v for k, v in LLAMA_TENSORS.items() if k != "layers/mlp_norm/scale"},
    "layers/attn_post_norm/scale": ("model.layers.{i}.post_attention_layernorm.weight", FLAT),
    "layers/mlp_norm/scale": ("model.layers.{i}.pre_feedforward_layernorm.weight", FLAT),
    "layers/mlp_post_norm/scale": ("model.layers.{i}.post_feedforward_layernorm.weight", FLAT),
}

PHI3_TENSORS = {  # q, k and v fused in qkv_proj; gate and up in gate_up_proj (gate first)
    **LLAMA_TENSORS,
    "layers/attn/wq": ("model.layers.{i}.self_attn.qkv_proj.weight", 1, 0),
    "layers/attn/wk": ("model.layers.{i}.self_attn.qkv_proj.weight", 1, 1),
    "layers/attn/wv": ("model.layers.{i}.self_attn.qkv_proj.weight", 1, 2),
    "layers/mlp/w_gate": ("model.layers.{i}.mlp.gate_up_proj.weight", 1, 0),
    "layers/mlp/w_up": ("model.layers.{i}.mlp.gate_up_proj.weight", 1, 1),
}

DENSE_MLP = ("layers/mlp/w_gate", "layers/mlp/w_up", "layers/mlp/w_down")
MIXTRAL_TENSORS = {  # the Hub's files keep each expert's weights apart
    **{k: v for k, v in LLAMA_TENSORS.items() if k not in DENSE_MLP},
    "layers/mlp/router": ("model.layers.{i}.block_sparse_moe.gate.weight", 1),
    "layers/mlp/w_gate": ("model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight", 1),
    "layers/mlp/w_up": ("model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight", 1),
    "layers/mlp/w_down": ("model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight", 1),
}
QWEN3_MOE_TENSORS = {
    **{k: v for k, v in LLAMA_TENSORS.items() if k not in DENSE_MLP},
    "layers/mlp/router": ("model.layers.{i}.mlp.gate.weight", 1),
    "layers/mlp/w_gate": ("model.layers.{i}.mlp.experts.{e}.gate_proj.weight", 1),
    "layers/mlp/w_up": ("model.layers.{i}.mlp.experts.{e}.up_proj.weight", 1),
    "layers/mlp/w_down": ("model.layers.{i}.mlp.experts.{e}.down_proj.weight", 1),
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
    experts: bool = False  # a mixture of experts (model.name=moe): config_json.EXPERT_FIELDS say how many
    known_as: str = ""  # the checkpoints' names on the Hub

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
    if hf.get("model_type") not in MULTIMODAL:
        return family_of(hf, "").tensors, ()
    layout = MULTIMODAL[hf["model_type"]]
    table = family_of(text_config(hf, ""), "").tensors

    def moved(name: str) -> str:
        prefix = next(p for p in layout["prefixes"] if name.startswith(p))
        return layout["prefixes"][prefix] + name.removeprefix(prefix)

    return {path: (moved(name), storage) for path, (name, storage) in table.items()}, layout["elsewhere"]


def family_of(hf: dict, where: str) -> HfFamily:
    kind = hf.get("model_type")
    if kind not in FAMILIES:
        kind = kind or (hf.get("architectures") or ["an unknown architecture"])[0]
        raise ConfigError(
            f"{where} holds a `{kind}` model; podtrain converts model_type {', '.join(FAMILIES)} "
            f"({', '.join(f.known_as for f in FAMILIES.values())}) and the language model of a multimodal "
            f"{', '.join(MULTIMODAL)}."
        )
    return FAMILIES[kind]
