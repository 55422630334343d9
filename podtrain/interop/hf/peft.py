"""A LoRA run's adapters in PEFT's format: adapter_model.safetensors and adapter_config.json, which
`peft.PeftModel.from_pretrained(base_model, OUT_DIR)` loads onto the run's base."""

from __future__ import annotations

import json
from pathlib import Path

from podtrain.config.schema import Config
from podtrain.errors import ConfigError
from podtrain.interop.hf.checkpoint import write_params
from podtrain.train import adapters

CONFIG = "adapter_config.json"


def write_adapter(params: dict, cfg: Config, tensors: dict, out: Path, dtype: str) -> list[str]:
    """The adapters of `params` under PEFT's names (from the family's tensor table) in `dtype`, with
    the config that says what they adapt and on which base. Returns the files written."""
    trained, _ = adapters.split(params)
    if not trained:
        raise ConfigError(f"{cfg.run_dir} trained no adapters (train.lora.rank=0); export it without --adapter.")
    table = adapters.peft_table(tensors, trained)
    written = write_params(trained, out, table, dtype, stem="adapter_model")
    lora = cfg.train.lora
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": cfg.train.init_from,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted({name.split(".")[-3] for name, _ in table.values()}),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
    }
    (out / CONFIG).write_text(json.dumps(config, indent=2))
    return [*written, CONFIG]
