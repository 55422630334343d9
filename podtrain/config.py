"""The config schema, and loading it from YAML, the environment and `key=value` overrides.

Precedence, lowest first: the defaults below (the embedded tiny job), a YAML file,
`TPU_MESH_CONFIG`/`TPU_AXIS_NAMES`, then command-line overrides. OmegaConf checks keys and
types; this module turns its exceptions into messages a user can act on.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from podtrain.errors import ConfigError


@dataclass
class ModelConfig:
    """The keys every model family has. Each family's config, beside its model and registered by
    name in podtrain.models, adds its own; `model.name` picks which one a config is checked against."""

    name: str = "llama"
    vocab_size: int = 256
    d_model: int = 128
    n_heads: int = 4
    d_ff: int = 384
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    remat: str = "none"  # none | full | dots
    scan_unroll: int = 1  # layers per scan iteration; the layer count unrolls fully
    compute_dtype: str = "auto"  # auto (bfloat16 on GPU/TPU, float32 on CPU) | float32 | bfloat16
    attention: str = "auto"  # auto (cudnn on GPU with bf16, xla otherwise) | xla | cudnn

    def validate(self) -> None:
        """Relations between this family's keys; subclasses add theirs."""
        if self.d_model % self.n_heads:
            raise ConfigError(f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}; pick sizes whose ratio is the head dimension.")


@dataclass
class MeshConfig:
    data: int = -1
    fsdp: int = 1
    tensor: int = 1


@dataclass
class TrainConfig:
    """The keys of every task; a task adds its own (TextTrainConfig)."""

    steps: int = 200
    batch_size: int = 16  # global, across all devices and processes
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    grad_accum: int = 1
    ema: float = 0.0  # decay of an exponential moving average of the weights (e.g. 0.999); 0 for none
    log_every: int = 20
    eval_every: int = 100
    eval_batches: int = 8


@dataclass
class TextTrainConfig(TrainConfig):
    """Language modelling: the window length and the closing sample."""

    seq_len: int = 256
    sample_tokens: int = 200  # text sampled from the model at the end; 0 for none


# A task's train keys: a puzzle's length is the data's, and puzzles are not sampled.
TRAIN_CONFIGS = {"text": TextTrainConfig, "puzzles": TrainConfig}


@dataclass
class CheckpointConfig:
    every: int = 100
    keep: int = 3
    dir: str | None = None  # default: RUN_DIR/checkpoints
    async_save: bool = True


@dataclass
class DataConfig:
    source: str = "pydoc"  # pydoc (the English docs every CPython ships) | text (data.path) | sudoku (data.path: `podtrain data sudoku --out DIR`)
    path: str | None = None
    val_fraction: float = 0.1


@dataclass
class DistributedConfig:
    init_timeout: int = 300  # seconds for all processes to join the coordinator


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)  # the family's config, by model.name
    mesh: MeshConfig = field(default_factory=MeshConfig)
    train: TrainConfig = field(default_factory=TrainConfig)  # the task's, by the family's task
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    data: DataConfig = field(default_factory=DataConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    device_type: str = "auto"  # auto | tpu | gpu | cuda | cpu
    run_dir: str = "runs/default"
    seed: int = 0

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir or Path(self.run_dir) / "checkpoints")


def default_config(model: str = "llama") -> Config:
    """The defaults for model family `model`: its model keys and its task's train keys. With
    `llama`, the embedded tiny job."""
    from podtrain.models import MODELS  # the families' configs live beside their models

    if model not in MODELS:
        match = difflib.get_close_matches(str(model), MODELS, n=1)
        hint = f" Did you mean {match[0]}?" if match else ""
        raise ConfigError(f"model.name={model!r} is not a known model; choose one of: {', '.join(MODELS)}.{hint}")
    family = MODELS[model]
    return Config(model=family.config(), train=TRAIN_CONFIGS[family.task]())


CHOICES = {
    "device_type": ("auto", "tpu", "gpu", "cuda", "cpu"),
    "model.remat": ("none", "full", "dots"),
    "model.compute_dtype": ("auto", "float32", "bfloat16"),
    "model.attention": ("auto", "xla", "cudnn"),
    "model.projection": ("sinkhorn", "permutations"),
    "data.source": ("pydoc", "text", "sudoku"),
}

# Integer keys that count something and so must be at least 1, where the family has them.
POSITIVE = (
    "train.steps", "train.batch_size", "train.seq_len", "train.grad_accum", "train.log_every", "train.eval_every",
    "checkpoint.every", "distributed.init_timeout", "model.n_layers", "model.scan_unroll", "model.streams", "model.sinkhorn_iters",
    "model.H_cycles", "model.L_cycles", "model.H_layers", "model.L_layers", "model.halt_max_steps", "model.puzzle_emb_len",
)  # fmt: skip

# Flags from the setup guides, each an alias of one config key.
FLAG_ALIASES = {
    "--batch-size": "train.batch_size",
    "--total-steps": "train.steps",
    "--mesh-data": "mesh.data",
    "--mesh-fsdp": "mesh.fsdp",
    "--mesh-tp": "mesh.tensor",
    "--checkpoint-dir": "checkpoint.dir",
    "--checkpoint-interval": "checkpoint.every",
    "--log-interval": "train.log_every",
    "--learning-rate": "train.lr",
}

MESH_AXIS_ALIASES = {"data": "data", "fsdp": "fsdp", "tensor": "tensor", "model": "tensor", "tp": "tensor"}


def all_keys(node: Any) -> list[str]:
    """Every dotted key of a config, e.g. `train.lr`."""
    keys = []
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        keys += [f"{f.name}.{k}" for k in all_keys(value)] if dataclasses.is_dataclass(value) else [f.name]
    return keys


def _read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"Config file {path} does not exist. Pass a YAML file (see configs/) or no file for the default job.")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"Config file {path} is not valid YAML: {e}. Fix the file (indentation and `key: value` pairs).") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"Config file {path} must hold a mapping of keys (like `train: {{steps: 100}}`), not a {type(data).__name__}.")
    return data


def mesh_from_env(environ=os.environ) -> list[str]:
    """`TPU_MESH_CONFIG="4,4,2"` with `TPU_AXIS_NAMES="data,model,fsdp"` as mesh overrides."""
    sizes = environ.get("TPU_MESH_CONFIG")
    if not sizes:
        return []
    names = environ.get("TPU_AXIS_NAMES", "data,fsdp,tensor").split(",")
    sizes = sizes.split(",")
    if len(names) != len(sizes):
        raise ConfigError(f"TPU_MESH_CONFIG={','.join(sizes)} has {len(sizes)} sizes but TPU_AXIS_NAMES has {len(names)} names; give one name per size.")
    overrides = []
    for name, size in zip(names, sizes):
        axis = MESH_AXIS_ALIASES.get(name.strip())
        if axis is None:
            raise ConfigError(f"TPU_AXIS_NAMES names an unknown mesh axis `{name}`; use data, fsdp and tensor (or its aliases model, tp).")
        overrides.append(f"mesh.{axis}={size.strip()}")
    return overrides


def _model_name(layers: list[Any]) -> str:
    """The `model.name` the layers end on (llama if none sets it)."""
    try:
        name = OmegaConf.select(OmegaConf.merge(*layers), "model.name", default="llama") if layers else "llama"
    except OmegaConfBaseException as e:
        raise ConfigError(f"Invalid config: {e.msg}") from None
    return str(name)


def _merge(defaults: Config, layers: list[Any]) -> Config:
    schema = OmegaConf.structured(defaults)
    try:
        return OmegaConf.to_object(OmegaConf.merge(schema, *layers))
    except ConfigKeyError as e:
        key = e.full_key or str(e.key)
        match = difflib.get_close_matches(key, all_keys(defaults), n=1, cutoff=0.5)
        hint = f" Did you mean `{match[0]}`?" if match else ""
        raise ConfigError(f"Unknown config key `{key}` for model.name={defaults.model.name}.{hint} The README lists the keys of each model.") from None
    except ValidationError as e:
        expected = type(OmegaConf.select(schema, e.full_key)).__name__ if e.full_key else "?"
        raise ConfigError(f"Config key `{e.full_key}` got {e.value!r}, which is not a valid {expected}. Give a value of type {expected}.") from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"Invalid config: {e.msg}") from None


def parse_overrides(items: list[str]) -> list[str]:
    for item in items:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"Override `{item}` is not of the form key=value (for example train.steps=100).")
    return list(items)


# `--use-small-model`: the layer sizes of the embedded tiny job, where the family has them.
SMALL_MODEL_KEYS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff")


def load_config(path: str | Path | None = None, overrides: list[str] = (), environ=os.environ, small_model: bool = False) -> Config:
    """The config of `path` with `overrides`, checked against the keys of its model family.
    `small_model` swaps in the tiny job's layer sizes; the vocabulary, sequence length and
    precision stay the recipe's, so its data and train.seq_len still fit."""
    layers = [OmegaConf.create(_read_yaml(path))] if path else []
    try:
        layers.append(OmegaConf.from_dotlist(mesh_from_env(environ) + parse_overrides(list(overrides))))
    except OmegaConfBaseException as e:
        raise ConfigError(f"Could not parse overrides: {e.msg}") from None
    defaults = default_config(_model_name(layers))
    if small_model:
        tiny = default_config().model
        sizes = [f"model.{k}={getattr(tiny, k)}" for k in SMALL_MODEL_KEYS if hasattr(defaults.model, k)]
        layers.insert(len(layers) - 1, OmegaConf.from_dotlist(sizes))
    cfg = _merge(defaults, layers)
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Checks that need more than a type: choices, ranges and relations between values."""
    tree = OmegaConf.structured(cfg)
    for key, options in CHOICES.items():
        value = OmegaConf.select(tree, key)
        if value is not None and value not in options:
            raise ConfigError(f"Config key `{key}` is {value!r}; choose one of: {', '.join(options)}.")
    for key in POSITIVE:
        value = OmegaConf.select(tree, key)
        if value is not None and value < 1:
            raise ConfigError(f"Config key `{key}` must be at least 1.")
    cfg.model.validate()
    t = cfg.train
    if getattr(t, "seq_len", 0) > cfg.model.max_seq_len:
        raise ConfigError(f"train.seq_len={t.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}; lower train.seq_len or raise model.max_seq_len.")
    if not 0 <= t.ema < 1:
        raise ConfigError(f"train.ema={t.ema} must be in [0, 1): the EMA decay per step (e.g. 0.999), or 0 for no EMA.")
    if t.batch_size % t.grad_accum:
        raise ConfigError(f"train.batch_size={t.batch_size} is not divisible by train.grad_accum={t.grad_accum}; each microbatch must have the same size.")
    if cfg.data.source == "text" and not cfg.data.path:
        raise ConfigError("data.source=text needs data.path=FILE_OR_DIR (a UTF-8 text file or a folder of .txt files).")
    if cfg.data.source == "sudoku" and not cfg.data.path:
        raise ConfigError("data.source=sudoku needs data.path=DIR, a folder built by `podtrain data sudoku --out DIR`.")


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(to_yaml(cfg))


def resolve_auto(cfg: Config, platform: str) -> Config:
    """Replace the `auto` precision and attention settings by what suits the platform."""
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model))
    m = cfg.model
    if m.compute_dtype == "auto":
        m.compute_dtype = "float32" if platform == "cpu" else "bfloat16"
    if m.attention == "auto":
        # cuDNN's fused attention wants 16-bit inputs and head_dim <= 128 in multiples of 8.
        head_dim = m.d_model // m.n_heads
        cudnn_ok = platform == "gpu" and m.compute_dtype == "bfloat16" and head_dim <= 128 and head_dim % 8 == 0
        m.attention = "cudnn" if cudnn_ok else "xla"
    return cfg
