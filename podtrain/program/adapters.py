"""LoRA in training (train.lora): which weights take adapters (models/lora.py), the params split into
the adapters, which the optimizer trains and the checkpoints keep, and the frozen base, and the
adapters merged into the base or named as PEFT names them, for export.

Params are nested dicts (nnx.to_pure_dict); an adapter is the subtree `lora_<weight>` = {a, b}
beside its weight.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from podtrain.config.schema import Config
from podtrain.errors import ConfigError
from podtrain.models import lora


def weights_adapted(cfg: Config) -> set[str]:
    """The model's weights that train.lora.targets names."""
    if not cfg.train.init_from:
        raise ConfigError(
            "train.lora.rank > 0 trains adapters on a base model; set train.init_from to its weights (a podtrain "
            "run directory, or a Hugging Face folder or hub name)."
        )
    if cfg.train.lora.dropout and cfg.mesh.stage > 1:
        raise ConfigError(
            f"train.lora.dropout={cfg.train.lora.dropout} with mesh.stage={cfg.mesh.stage}: in a pipeline the "
            "microbatches of a step would share their dropout masks; set train.lora.dropout=0 or mesh.stage=1."
        )
    targets = cfg.train.lora.targets
    unknown = sorted(set(targets) - set(lora.PROJECTIONS.values()))
    if unknown or not targets:
        raise ConfigError(
            f"train.lora.targets={list(targets)}: {', '.join(unknown) or 'none given'} is not a projection LoRA "
            f"adapts; name some of {', '.join(lora.PROJECTIONS.values())}."
        )
    attention = sorted(t for t in targets if t.endswith(("q_proj", "k_proj", "v_proj", "o_proj")))
    if attention and getattr(cfg.model, "attention_kind", "gqa") == "mla":
        raise ConfigError(
            f"train.lora.targets has {', '.join(attention)}, and model.attention_kind=mla's latent attention takes "
            "no adapters; adapt the dense MLPs (gate_proj, up_proj, down_proj) alone, or train the whole model."
        )
    return {weight for weight, projection in lora.PROJECTIONS.items() if projection in targets}


def merged(params: dict, scale: float) -> dict:
    """The weights alone, each adapted one W + scale A B, as host arrays in W's dtype."""
    adapters, base = lora.split(params)

    def merge(base: dict, adapters: dict) -> dict:
        out = dict(base)
        for key, value in adapters.items():
            if not str(key).startswith(lora.PREFIX):
                out[key] = merge(base[key], value)
                continue
            weight = key.removeprefix(lora.PREFIX)
            w = np.asarray(jax.device_get(base[weight]))
            a, b = (np.asarray(jax.device_get(value[k]), np.float32) for k in "ab")
            lead = a.ndim + b.ndim - 2 - w.ndim  # the stacked layers' axes, which W, A and B share
            a, b = a.reshape(*a.shape[:lead], -1, a.shape[-1]), b.reshape(*b.shape[: lead + 1], -1)
            delta = np.einsum("...ir,...ro->...io", a, b)
            out[weight] = (w.astype(np.float32) + scale * delta.reshape(w.shape)).astype(w.dtype)
        return out

    return merge(base, adapters)


def compute_dtype(abstract, dtype) -> dict:
    """`abstract` (ShapeDtypeStructs) in `dtype`, with the same shardings."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.dtype(dtype), sharding=s.sharding), abstract)
