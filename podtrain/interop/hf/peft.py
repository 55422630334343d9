"""A LoRA run's adapters in PEFT's format: adapter_model.safetensors and adapter_config.json, which
`peft.PeftModel.from_pretrained(base_model, OUT_DIR)` loads onto the run's base."""

from __future__ import annotations

import json
from pathlib import Path

import jax

from podtrain.config.schema import Config
from podtrain.errors import ConfigError
from podtrain.interop.hf.checkpoint import write_params
from podtrain.models import lora

CONFIG = "adapter_config.json"


def write_adapter(params: dict, cfg: Config, tensors: dict, out: Path, dtype: str) -> list[str]:
    """The adapters of `params` under PEFT's names (from the family's tensor table) in `dtype`, with
    the config that says what they adapt and on which base. Returns the files written."""
    trained, _ = lora.split(params)
    if not trained:
        raise ConfigError(f"{cfg.run_dir} trained no adapters (train.lora.rank=0); export it without --adapter.")
    table = peft_table(tensors, trained)
    written = write_params(trained, out, table, dtype, stem="adapter_model")
    adapted = cfg.train.lora
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": cfg.train.init_from,
        "r": adapted.rank,
        "lora_alpha": adapted.alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted({name.split(".")[-3] for name, _ in table.values()}),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
    }
    (out / CONFIG).write_text(json.dumps(config, indent=2))
    return [*written, CONFIG]


def peft_table(tensors: dict, adapters: dict) -> dict:
    """PEFT's names for `adapters` from a family's tensor table: A as lora_A (rank, in), B as lora_B
    (out, rank) of the projection, under base_model.model. Fused projections (Phi-3's qkv_proj) have
    one adapter in PEFT and separate ones here: refused."""
    table = {}
    for path, _ in jax.tree_util.tree_flatten_with_path(adapters)[0]:
        keys = [str(k.key) for k in path]
        weight = "/".join([*keys[:-2], keys[-2].removeprefix(lora.PREFIX)])
        name, in_axes, *part = tensors[weight]
        if part:
            raise ConfigError(
                f"{name} fuses several projections in one tensor, which PEFT adapts as one; export the model "
                "with the adapters merged (convert --to-hf without --adapter)."
            )
        matrix = "lora_A" if keys[-1] == "a" else "lora_B"
        peft_name = f"base_model.model.{name.removesuffix('.weight')}.{matrix}.weight"
        table["/".join(keys)] = (peft_name, in_axes if matrix == "lora_A" else 1)
    return table
