"""The config schema, and loading it from YAML, the environment and `key=value` overrides.

Precedence, lowest first: the defaults below (the embedded tiny job), a YAML file,
`TPU_MESH_CONFIG`/`TPU_AXIS_NAMES`, then command-line overrides. OmegaConf checks keys and
types; this module turns its exceptions into messages a user can act on.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from podtrain.errors import ConfigError


@dataclass(frozen=True)
class Range:
    """The valid values of a numeric key: finite numbers in an interval, written as in the README:
    `> 0`, `>= 1`, `[0, 1)`, `finite`, or `-1 or >= 1` (-1 meaning "the rest")."""

    text: str

    def _parts(self) -> tuple[bool, float, float, bool, bool]:
        """(minus_one_allowed, low, high, low_open, high_open)."""
        text, minus_one = self.text, self.text.startswith("-1 or ")
        text = text.removeprefix("-1 or ")
        if text == "finite":
            return minus_one, -math.inf, math.inf, True, True
        if m := re.fullmatch(r"(>=?) (\S+)", text):
            return minus_one, float(m[2]), math.inf, m[1] == ">", True
        m = re.fullmatch(r"([\[(])(\S+), (\S+)([\])])", text)
        return minus_one, float(m[2]), float(m[3]), m[1] == "(", m[4] == ")"

    def __contains__(self, value) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        minus_one, low, high, low_open, high_open = self._parts()
        if minus_one and value == -1:
            return True
        return (low < value if low_open else low <= value) and (value < high if high_open else value <= high)

    def __str__(self) -> str:
        return self.text


def ranged(default, valid: str):
    """A numeric config key with its default and its valid values (a Range), e.g. ranged(0.9, "[0, 1)")."""
    Range(valid)._parts()  # a malformed range fails at import
    return field(default=default, metadata={"range": Range(valid)})


@dataclass
class ModelConfig:
    """The keys every model family has. Each family's config, beside its model and registered by
    name in podtrain.models, adds its own; `model.name` picks which one a config is checked against."""

    name: str = "llama"
    vocab_size: int = ranged(256, ">= 1")
    d_model: int = ranged(128, ">= 1")
    n_heads: int = ranged(4, ">= 1")
    d_ff: int = ranged(384, ">= 1")
    max_seq_len: int = ranged(256, ">= 1")
    rope_theta: float = ranged(10000.0, "> 0")
    norm_eps: float = ranged(1e-5, "> 0")
    remat: str = "none"  # none | full | dots
    scan_unroll: int = ranged(1, ">= 1")  # layers per scan iteration; the layer count unrolls fully
    compute_dtype: str = "auto"  # auto (bfloat16 on GPU/TPU, float32 on CPU) | float32 | bfloat16
    attention: str = (
        "auto"  # auto (cudnn on GPU with bf16, splash on TPU, xla otherwise) | xla | cudnn | splash (Pallas, TPU)
    )

    def validate(self) -> None:
        """Relations between this family's keys; subclasses add theirs."""
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}; pick sizes whose ratio is the head dimension."
            )


@dataclass
class MeshConfig:
    data: int = ranged(-1, "-1 or >= 1")
    fsdp: int = ranged(1, "-1 or >= 1")
    tensor: int = ranged(1, "-1 or >= 1")


@dataclass
class TrainConfig:
    """The keys of every task; a task adds its own (TextTrainConfig)."""

    steps: int = ranged(200, ">= 1")
    batch_size: int = ranged(16, ">= 1")  # global, across all devices and processes
    lr: float = ranged(2e-3, "> 0")
    min_lr_ratio: float = ranged(0.1, "[0, 1]")
    warmup_steps: int = ranged(20, ">= 0")
    weight_decay: float = ranged(0.1, ">= 0")
    beta1: float = ranged(0.9, "[0, 1)")
    beta2: float = ranged(0.95, "[0, 1)")
    grad_clip: float = ranged(1.0, ">= 0")  # 0: off
    grad_accum: int = ranged(1, ">= 1")
    init_from: str = ""  # start from these weights (a podtrain run_dir, or a Hugging Face Llama folder or hub name) with a fresh optimizer
    ema: float = ranged(0.0, "[0, 1)")  # decay of an exponential moving average of the weights (e.g. 0.999); 0 for none
    log_every: int = ranged(20, ">= 1")
    eval_every: int = ranged(100, ">= 0")  # 0: only after the last step
    eval_batches: int = ranged(8, ">= 1")
    max_bad_steps: int = ranged(3, ">= 1")  # non-finite steps in a row (each skipped) before training stops


@dataclass
class TextTrainConfig(TrainConfig):
    """Language modelling: the window length and the closing sample."""

    seq_len: int = ranged(256, ">= 1")
    sample_tokens: int = ranged(200, ">= 0")  # text sampled from the model at the end; 0 for none


# A task's train keys: a puzzle's length is the data's, and puzzles are not sampled.
TRAIN_CONFIGS = {"text": TextTrainConfig, "puzzles": TrainConfig}


@dataclass
class CheckpointConfig:
    every: int = ranged(100, ">= 0")  # 0: only after the last step
    keep: int = ranged(3, ">= 1")
    dir: str | None = None  # default: RUN_DIR/checkpoints
    async_save: bool = True


@dataclass
class DataConfig:
    # pydoc (the English docs every CPython ships) | text (a local corpus at data.path, tokenized in memory)
    # | tokens (data.path: `podtrain data prepare --out DIR`) | sudoku (data.path: `podtrain data sudoku --out DIR`)
    source: str = "pydoc"
    path: str | None = None
    tokenizer: str = "auto"  # auto (the shards' own for tokens, else bytes) | bytes | a folder with tokenizer.json | a hub model's name
    pack: str = "concat"  # concat: documents joined by EOS into rows | documents: attention stays inside each document
    val_fraction: float = ranged(0.1, "(0, 1)")  # in-memory text; prepared shards have their own split
    dataset_name: str | None = None  # if set, the config of the hub dataset the shards must come from
    workers: int = ranged(0, ">= 0")  # loader processes (grain); 0: threads of this process
    prefetch: int = ranged(2, ">= 0")  # batches read ahead of the step


@dataclass
class DistributedConfig:
    init_timeout: int = ranged(300, ">= 1")  # seconds for all processes to join the coordinator


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)  # the family's config, by model.name
    mesh: MeshConfig = field(default_factory=MeshConfig)
    train: TrainConfig = field(default_factory=TrainConfig)  # the task's, by the family's task
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    data: DataConfig = field(default_factory=DataConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    device_type: str = "auto"  # auto | tpu | gpu | cuda | cpu
    compile_cache: str = "auto"  # where compiled programs are kept for later runs: auto ($XDG_CACHE_HOME or ~/.cache, then podtrain/xla), a folder, or off
    run_dir: str = "runs/default"
    seed: int = ranged(0, ">= 0")

    @property
    def checkpoint_dir(self) -> str:
        """A string, not a Path: Path would turn gs://bucket/run into the local gs:/bucket/run."""
        return self.checkpoint.dir or str(Path(self.run_dir) / "checkpoints")


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
    "model.attention": ("auto", "xla", "cudnn", "splash"),
    "model.rope_scaling": ("none", "llama3"),
    "model.projection": ("sinkhorn", "permutations"),
    "data.source": ("pydoc", "text", "tokens", "sudoku"),
    "data.pack": ("concat", "documents"),
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
    "--dataset": "data.path",
    "--dataset-name": "data.dataset_name",
    "--tokenizer": "data.tokenizer",
    "--worker-buffer-size": "data.prefetch",
}

MESH_AXIS_ALIASES = {"data": "data", "fsdp": "fsdp", "tensor": "tensor", "model": "tensor", "tp": "tensor"}


def leaves(node: Any, prefix: str = "") -> list[tuple[str, dataclasses.Field, Any]]:
    """(dotted key, field, value) of every value of a config, e.g. ("train.lr", its field, 0.002)."""
    found = []
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        found += (
            leaves(value, f"{prefix}{f.name}.") if dataclasses.is_dataclass(value) else [(prefix + f.name, f, value)]
        )
    return found


def all_keys(node: Any) -> list[str]:
    return [key for key, _, _ in leaves(node)]


def ranges(node: Any) -> list[tuple[str, Range, Any]]:
    """(dotted key, valid values, value) of every numeric key of a config."""
    return [(key, f.metadata["range"], value) for key, f, value in leaves(node) if "range" in f.metadata]


def _read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"Config file {path} does not exist. Pass a YAML file (see configs/) or no file for the default job."
        )
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(
            f"Config file {path} is not valid YAML: {e}. Fix the file (indentation and `key: value` pairs)."
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"Config file {path} must hold a mapping of keys (like `train: {{steps: 100}}`), not a {type(data).__name__}."
        )
    return data


def mesh_from_env(environ=os.environ) -> list[str]:
    """`TPU_MESH_CONFIG="4,4,2"` with `TPU_AXIS_NAMES="data,model,fsdp"` as mesh overrides."""
    sizes = environ.get("TPU_MESH_CONFIG")
    if not sizes:
        return []
    names = environ.get("TPU_AXIS_NAMES", "data,fsdp,tensor").split(",")
    sizes = sizes.split(",")
    if len(names) != len(sizes):
        raise ConfigError(
            f"TPU_MESH_CONFIG={','.join(sizes)} has {len(sizes)} sizes but TPU_AXIS_NAMES has {len(names)} names; give one name per size."
        )
    overrides = []
    for name, size in zip(names, sizes):
        axis = MESH_AXIS_ALIASES.get(name.strip())
        if axis is None:
            raise ConfigError(
                f"TPU_AXIS_NAMES names an unknown mesh axis `{name}`; use data, fsdp and tensor (or its aliases model, tp)."
            )
        overrides.append(f"mesh.{axis}={size.strip()}")
    return overrides


def _select(layers: list[Any], key: str):
    """The value `key` ends on in the layers, before any type checks (None if unset)."""
    try:
        return OmegaConf.select(OmegaConf.merge(*layers), key, default=None) if layers else None
    except OmegaConfBaseException as e:
        raise ConfigError(f"Invalid config: {e.msg}") from None


def _merge(defaults: Config, layers: list[Any]) -> Config:
    schema = OmegaConf.structured(defaults)
    try:
        return OmegaConf.to_object(OmegaConf.merge(schema, *layers))
    except ConfigKeyError as e:
        key = e.full_key or str(e.key)
        match = difflib.get_close_matches(key, all_keys(defaults), n=1, cutoff=0.5)
        hint = f" Did you mean `{match[0]}`?" if match else ""
        raise ConfigError(
            f"Unknown config key `{key}` for model.name={defaults.model.name}.{hint} The README lists the keys of each model."
        ) from None
    except ValidationError as e:
        expected = type(OmegaConf.select(schema, e.full_key)).__name__ if e.full_key else "?"
        raise ConfigError(
            f"Config key `{e.full_key}` got {e.value!r}, which is not a valid {expected}. Give a value of type {expected}."
        ) from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"Invalid config: {e.msg}") from None


def parse_overrides(items: list[str]) -> list[str]:
    for item in items:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"Override `{item}` is not of the form key=value (for example train.steps=100).")
    return list(items)


# `--use-small-model`: the layer sizes of the embedded tiny job, where the family has them.
SPLASH_BLOCK = 128  # the splash-attention kernel's blocks of queries and keys

SMALL_MODEL_KEYS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff")


def load_config(
    path: str | Path | None = None, overrides: list[str] = (), environ=os.environ, small_model: bool = False
) -> Config:
    """The config of `path` with `overrides`, checked against the keys of its model family.
    `small_model` swaps in the tiny job's layer sizes; the vocabulary, sequence length and
    precision stay the recipe's, so its data and train.seq_len still fit."""
    layers = []
    if path:
        data = _read_yaml(path)
        check_structure(data, str(path))
        layers.append(OmegaConf.create(data))
    try:
        layers.append(OmegaConf.from_dotlist(mesh_from_env(environ) + parse_overrides(list(overrides))))
    except OmegaConfBaseException as e:
        raise ConfigError(f"Could not parse overrides: {e.msg}") from None
    check_structure(OmegaConf.to_container(layers[-1]), "the overrides")
    defaults = default_config(str(_select(layers, "model.name") or "llama"))
    auto_vocab = _select(layers, "model.vocab_size") == "auto"
    for layer in layers if auto_vocab else []:  # a placeholder until the data is known
        if OmegaConf.select(layer, "model.vocab_size") == "auto":
            OmegaConf.update(layer, "model.vocab_size", 1)
    if small_model:
        tiny = default_config().model
        sizes = [f"model.{k}={getattr(tiny, k)}" for k in SMALL_MODEL_KEYS if hasattr(defaults.model, k)]
        layers.insert(len(layers) - 1, OmegaConf.from_dotlist(sizes))
    cfg = _merge(defaults, layers)
    if auto_vocab:
        cfg.model.vocab_size = auto_vocab_size(cfg)
    validate(cfg)
    return cfg


def auto_vocab_size(cfg: Config) -> int:
    """`model.vocab_size=auto`: the data's tokenizer's vocabulary rounded up to a multiple of 128."""
    from podtrain.data.text import data_tokenizer  # data reads configs; only this needs data
    from podtrain.data.tokenizer import vocab_for

    if cfg.data.source == "sudoku":
        raise ConfigError(
            "model.vocab_size=auto reads a tokenizer's vocabulary; Sudoku's is fixed (11), give it as a number."
        )
    return vocab_for(data_tokenizer(cfg.data))


def check_structure(data: dict, where: str) -> None:
    """Sections are mappings of single values: say so, naming the key, before OmegaConf's errors would."""
    for name, value in data.items():
        section = dataclasses.is_dataclass(getattr(Config(), str(name), None))
        if section and not isinstance(value, dict):
            raise ConfigError(
                f"`{name}` in {where} must be a mapping of keys (like `{name}: {{key: value}}`), not `{value!r}`."
            )
        for key, item in value.items() if section else [(None, value)]:
            full = f"{name}.{key}" if key is not None else str(name)
            if isinstance(item, (dict, list)):
                raise ConfigError(
                    f"Config key `{full}` in {where} must be a single value (a number, string or boolean), not `{item!r}`."
                )


def validate(cfg: Config) -> None:
    """Checks that need more than a type: choices, ranges and relations between values."""
    tree = OmegaConf.structured(cfg)
    for key, options in CHOICES.items():
        value = OmegaConf.select(tree, key)
        if value is not None and value not in options:
            raise ConfigError(f"Config key `{key}` is {value!r}; choose one of: {', '.join(options)}.")
    for key, valid, value in ranges(cfg):
        if value not in valid:
            raise ConfigError(
                f"Config key `{key}` is {value!r}, outside its valid values: {valid}, finite. Give a value in that range; the README lists each key's."
            )
    cfg.model.validate()
    t = cfg.train
    if getattr(t, "seq_len", 0) > cfg.model.max_seq_len:
        raise ConfigError(
            f"train.seq_len={t.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}; lower train.seq_len or raise model.max_seq_len."
        )
    if t.batch_size % t.grad_accum:
        raise ConfigError(
            f"train.batch_size={t.batch_size} is not divisible by train.grad_accum={t.grad_accum}; each microbatch must have the same size."
        )
    if cfg.data.source in ("text", "tokens") and not cfg.data.path:
        folder = (
            "FILE_OR_DIR (a corpus file or folder: .txt, .md, .jsonl, .json, .parquet)"
            if cfg.data.source == "text"
            else "DIR, a folder made by `podtrain data prepare --out DIR`"
        )
        raise ConfigError(f"data.source={cfg.data.source} needs data.path={folder}.")
    if cfg.data.source == "pydoc" and cfg.data.path:
        raise ConfigError(
            f"data.path={cfg.data.path} is set, but data.source=pydoc reads the built-in text; set data.source=tokens (shards from `podtrain data prepare`) or text (a local corpus)."
        )
    if cfg.model.attention == "splash" and getattr(t, "seq_len", 1) % SPLASH_BLOCK:
        raise ConfigError(
            f"model.attention=splash runs blocks of {SPLASH_BLOCK} positions: make train.seq_len a multiple of {SPLASH_BLOCK} (puzzles are not), or use model.attention=xla."
        )
    if cfg.data.pack == "documents" and cfg.model.attention in ("cudnn", "splash"):
        raise ConfigError(
            f"data.pack=documents keeps attention inside documents with a mask, which model.attention={cfg.model.attention} does not take; use model.attention=xla (or auto)."
        )
    if cfg.data.source == "sudoku" and not cfg.data.path:
        raise ConfigError("data.source=sudoku needs data.path=DIR, a folder built by `podtrain data sudoku --out DIR`.")


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def save_config(cfg: Config, path: str | Path) -> None:
    """Written whole or not at all (a temporary file renamed over it), so a kill leaves the last one."""
    temporary = Path(f"{path}.tmp")
    temporary.write_text(to_yaml(cfg))
    temporary.replace(path)


def run_config(run_dir: str | Path) -> Config:
    """The config a run was trained with, from RUN_DIR/config.yaml."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(
            f"{run_dir} is not a run directory (no config.yaml); give the run_dir of a `podtrain train` run."
        )
    return load_config(path)


def _flat(node: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in node.items():
        flat.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key: value})
    return flat


def differences(path: str | Path, cfg: Config) -> list[str]:
    """'key (old there, new here)' for each key whose value in the config file at `path` differs from cfg's."""
    old, new = _flat(yaml.safe_load(Path(path).read_text()) or {}), _flat(yaml.safe_load(to_yaml(cfg)))
    return [
        f"{key} ({old.get(key)} there, {new.get(key)} here)"
        for key in sorted(old.keys() | new.keys())
        if old.get(key) != new.get(key)
    ]


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
        splash_ok = platform == "tpu" and getattr(cfg.train, "seq_len", 1) % SPLASH_BLOCK == 0  # text of whole blocks
        fused = "cudnn" if cudnn_ok else "splash" if splash_ok else "xla"
        m.attention = fused if cfg.data.pack != "documents" else "xla"
    return cfg
