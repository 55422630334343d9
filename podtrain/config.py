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
class MhcConfig:
    streams: int = 4  # parallel residual streams (n)
    sinkhorn_iters: int = 20
    projection: str = "sinkhorn"  # sinkhorn (mHC) | permutations (mHC-lite, streams <= 4)
    alpha_init: float = 0.01  # initial gate of the input-dependent part of the mixing


@dataclass
class RecursiveConfig:
    """HRM / TRM recursion, under the names of their reference configs."""

    H_cycles: int = 3
    L_cycles: int = 6
    H_layers: int = 0  # HRM's high-level module; TRM has one network (L_layers) for both updates
    L_layers: int = 2
    halt_max_steps: int = 16
    halt_exploration_prob: float = 0.1
    no_ACT_continue: bool = True  # halt when q_halt > 0 (TRM); False: when q_halt > q_continue, with q_continue's loss (HRM)
    puzzle_emb_len: int = 16  # sequence positions in front of the puzzle for its learned embedding
    num_puzzle_ids: int = 1  # one shared puzzle embedding for Sudoku
    mlp_t: bool = False  # TRM: an MLP across the sequence instead of attention (the Sudoku variant)


@dataclass
class ModelConfig:
    name: str = "llama"
    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    d_ff: int = 384
    max_seq_len: int = 256
    tie_embeddings: bool = True
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    remat: str = "none"  # none | full | dots
    scan_unroll: int = 1  # layers per scan iteration; n_layers unrolls fully
    compute_dtype: str = "auto"  # auto (bfloat16 on GPU/TPU, float32 on CPU) | float32 | bfloat16
    attention: str = "auto"  # auto (cudnn on GPU with bf16, xla otherwise) | xla | cudnn
    mhc: MhcConfig = field(default_factory=MhcConfig)  # used by model.name=mhc
    hrm: RecursiveConfig = field(default_factory=lambda: RecursiveConfig(H_cycles=2, L_cycles=2, H_layers=4, L_layers=4, puzzle_emb_len=1, no_ACT_continue=False))
    trm: RecursiveConfig = field(default_factory=RecursiveConfig)


@dataclass
class MeshConfig:
    data: int = -1
    fsdp: int = 1
    tensor: int = 1


@dataclass
class TrainConfig:
    steps: int = 200
    batch_size: int = 16  # global, across all devices and processes
    seq_len: int = 256
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
    sample_tokens: int = 200  # text sampled from the model at the end; 0 for none


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
    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    data: DataConfig = field(default_factory=DataConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    device_type: str = "auto"  # auto | tpu | gpu | cuda | cpu
    run_dir: str = "runs/default"
    seed: int = 0

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir or Path(self.run_dir) / "checkpoints")


CHOICES = {
    "device_type": ("auto", "tpu", "gpu", "cuda", "cpu"),
    "model.remat": ("none", "full", "dots"),
    "model.compute_dtype": ("auto", "float32", "bfloat16"),
    "model.attention": ("auto", "xla", "cudnn"),
    "model.mhc.projection": ("sinkhorn", "permutations"),
    "data.source": ("pydoc", "text", "sudoku"),
}

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


def all_keys(node: Any = Config, prefix: str = "") -> list[str]:
    """Every dotted key of the schema, e.g. `train.lr`."""
    keys = []
    for f in dataclasses.fields(node):
        section = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        keys += all_keys(section, f"{prefix}{f.name}.") if dataclasses.is_dataclass(section) else [prefix + f.name]
    return keys


def _closest(key: str) -> str:
    match = difflib.get_close_matches(key, all_keys(), n=1, cutoff=0.5)
    return f" Did you mean `{match[0]}`?" if match else ""


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


def _merge(layers: list[Any]) -> Config:
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), *layers)
        return OmegaConf.to_object(merged)
    except ConfigKeyError as e:
        key = e.full_key or str(e.key)
        raise ConfigError(f"Unknown config key `{key}`.{_closest(key)} All keys are listed in the README.") from None
    except ValidationError as e:
        expected = type(OmegaConf.select(OmegaConf.structured(Config), e.full_key)).__name__ if e.full_key else "?"
        raise ConfigError(f"Config key `{e.full_key}` got {e.value!r}, which is not a valid {expected}. Give a value of type {expected}.") from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"Invalid config: {e.msg}") from None


def parse_overrides(items: list[str]) -> list[str]:
    for item in items:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"Override `{item}` is not of the form key=value (for example train.steps=100).")
    return list(items)


def load_config(path: str | Path | None = None, overrides: list[str] = (), environ=os.environ) -> Config:
    layers = [OmegaConf.create(_read_yaml(path))] if path else []
    try:
        layers.append(OmegaConf.from_dotlist(mesh_from_env(environ) + parse_overrides(list(overrides))))
    except OmegaConfBaseException as e:
        raise ConfigError(f"Could not parse overrides: {e.msg}") from None
    cfg = _merge(layers)
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Checks that need more than a type: choices and relations between values."""
    tree = OmegaConf.structured(cfg)
    for key, options in CHOICES.items():
        value = OmegaConf.select(tree, key)
        if value not in options:
            raise ConfigError(f"Config key `{key}` is {value!r}; choose one of: {', '.join(options)}.")
    m, t = cfg.model, cfg.train
    if m.d_model % m.n_heads:
        raise ConfigError(f"model.d_model={m.d_model} is not divisible by model.n_heads={m.n_heads}; pick sizes whose ratio is the head dimension.")
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(f"model.n_heads={m.n_heads} is not a multiple of model.n_kv_heads={m.n_kv_heads}; grouped-query attention shares each kv head by a whole number of query heads.")
    if t.seq_len > m.max_seq_len:
        raise ConfigError(f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}; lower train.seq_len or raise model.max_seq_len.")
    for key in ("train.steps", "train.batch_size", "train.seq_len", "train.grad_accum", "train.log_every", "train.eval_every", "checkpoint.every", "distributed.init_timeout", "model.n_layers", "model.scan_unroll", "model.mhc.streams", "model.mhc.sinkhorn_iters"):
        if OmegaConf.select(tree, key) < 1:
            raise ConfigError(f"Config key `{key}` must be at least 1.")
    if not 0 <= t.ema < 1:
        raise ConfigError(f"train.ema={t.ema} must be in [0, 1): the EMA decay per step (e.g. 0.999), or 0 for no EMA.")
    if t.batch_size % t.grad_accum:
        raise ConfigError(f"train.batch_size={t.batch_size} is not divisible by train.grad_accum={t.grad_accum}; each microbatch must have the same size.")
    if m.mhc.projection == "permutations" and m.mhc.streams > 4:
        raise ConfigError(f"model.mhc.projection=permutations mixes all {m.mhc.streams}! permutations of the streams; use model.mhc.streams<=4 or projection=sinkhorn.")
    if cfg.data.source == "text" and not cfg.data.path:
        raise ConfigError("data.source=text needs data.path=FILE_OR_DIR (a UTF-8 text file or a folder of .txt files).")
    if cfg.data.source == "sudoku" and not cfg.data.path:
        raise ConfigError("data.source=sudoku needs data.path=DIR, a folder built by `podtrain data sudoku --out DIR`.")
    for key in ("model.hrm", "model.trm"):
        r = OmegaConf.select(tree, key)
        if r.halt_max_steps < 1 or r.H_cycles < 1 or r.L_cycles < 1 or r.puzzle_emb_len < 1:
            raise ConfigError(f"{key}.H_cycles, L_cycles, halt_max_steps and puzzle_emb_len must each be at least 1.")


SMALL_MODEL_KEYS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff")


def tiny_model_overrides() -> list[str]:
    """`--use-small-model`: the layer dimensions of the embedded tiny job. The vocabulary, sequence
    length and precision stay the recipe's, so its data and train.seq_len still fit."""
    tiny = ModelConfig()
    return [f"model.{k}={getattr(tiny, k)}" for k in SMALL_MODEL_KEYS]


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
