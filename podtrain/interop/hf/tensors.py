"""Each Hugging Face family's tensors by podtrain parameter: the tables `families.py` gives its
records, read and written by `checkpoint.py`. Importing nothing, it lets the families table load
without jax (for the command line's help)."""

from __future__ import annotations

# How a podtrain array is stored in a table entry (name, in_axes[, part]). The name's {i} is the
# layer and {e} the expert: the array's first axes index them, one tensor each. in_axes k > 0 is a torch
# Linear weight (out, in) whose input side is the array's first k axes, stored transposed; FLAT is a
# vector (a bias, a norm's scale) stored as one axis; AS_IS is stored with the array's own shape.
# Entries that share a name and number their `part` are one fused tensor (Phi-3's qkv_proj), their
# rows one after another in that order.
FLAT, AS_IS = 0, None

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


# DeepSeek-V3: latent attention on every layer, a dense MLP on the first ones (model.dense_layers,
# numbered before model.layers: checkpoint.STACKS), routed and shared experts on the rest.
LATENT_ATTENTION = {
    "attn/wq": ("self_attn.q_proj.weight", 1),
    "attn/wq_a": ("self_attn.q_a_proj.weight", 1),
    "attn/q_a_norm/scale": ("self_attn.q_a_layernorm.weight", FLAT),
    "attn/wq_b": ("self_attn.q_b_proj.weight", 1),
    "attn/wkv_a": ("self_attn.kv_a_proj_with_mqa.weight", 1),
    "attn/kv_a_norm/scale": ("self_attn.kv_a_layernorm.weight", FLAT),
    "attn/wkv_b": ("self_attn.kv_b_proj.weight", 1),
    "attn/wo": ("self_attn.o_proj.weight", 2),
    "attn_norm/scale": ("input_layernorm.weight", FLAT),
    "mlp_norm/scale": ("post_attention_layernorm.weight", FLAT),
}
DEEPSEEK_EXPERTS = {
    "mlp/router": ("mlp.gate.weight", 1),
    "mlp/router_bias": ("mlp.gate.e_score_correction_bias", FLAT),
    "mlp/w_gate": ("mlp.experts.{e}.gate_proj.weight", 1),
    "mlp/w_up": ("mlp.experts.{e}.up_proj.weight", 1),
    "mlp/w_down": ("mlp.experts.{e}.down_proj.weight", 1),
    "mlp/shared/w_gate": ("mlp.shared_experts.gate_proj.weight", 1),
    "mlp/shared/w_up": ("mlp.shared_experts.up_proj.weight", 1),
    "mlp/shared/w_down": ("mlp.shared_experts.down_proj.weight", 1),
}
DENSE = {
    "mlp/w_gate": ("mlp.gate_proj.weight", 1),
    "mlp/w_up": ("mlp.up_proj.weight", 1),
    "mlp/w_down": ("mlp.down_proj.weight", 1),
}
DEEPSEEK_V3_TENSORS = {
    **{k: v for k, v in LLAMA_TENSORS.items() if not k.startswith("layers/")},
    **{
        f"dense_layers/{k}": (f"model.layers.{{i}}.{name}", how)
        for k, (name, how) in (LATENT_ATTENTION | DENSE).items()
    },
    **{
        f"layers/{k}": (f"model.layers.{{i}}.{name}", how)
        for k, (name, how) in (LATENT_ATTENTION | DEEPSEEK_EXPERTS).items()
    },
}
