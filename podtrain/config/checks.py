"""Checks of a loaded config that need more than a type (ranges, relations between values), and
the `auto` values a platform resolves. `load.py` runs `validate` on every config it loads."""

from __future__ import annotations

import dataclasses
import importlib.util

from podtrain import storage
from podtrain.config.schema import Config, ranges
from podtrain.errors import ConfigError, StorageError
from podtrain.models.attention import SPLASH_BLOCK

DATA_FOLDERS = {  # what data.path must name for each source that reads one
    "text": "FILE_OR_DIR (a corpus file or folder: .txt, .md, .jsonl, .json, .parquet)",
    "tokens": "DIR, a folder made by `podtrain data prepare --out DIR`",
    "sudoku": "DIR, a folder built by `podtrain data sudoku --out DIR`",
}


def check_paths(cfg: Config) -> None:
    """Each path is local or in a bucket podtrain serves; checkpoint arrays go where orbax writes them."""
    paths = (cfg.run_dir, cfg.checkpoint.dir, cfg.data.path, cfg.data.tokenizer, cfg.train.init_from, cfg.compile_cache)
    for value in paths:
        if value:
            storage.scheme(value)
    if storage.scheme(cfg.checkpoint_dir) == "s3":
        raise StorageError(
            f"Checkpoints cannot go to {cfg.checkpoint_dir}: orbax writes checkpoint arrays to local paths and "
            "gs:// only. Set checkpoint.dir to a gs:// bucket or a local (or mounted, e.g. mountpoint-s3) folder; "
            "the rest of the run may stay in s3://."
        )


def validate(cfg: Config) -> None:
    """Checks that need more than a type: ranges and relations between values."""
    for name, valid, value in ranges(cfg):
        if value not in valid:
            raise ConfigError(
                f"Config key `{name}` is {value!r}, outside its valid values: {valid}, finite. "
                "Give a value in that range; docs/configuration.md lists each key's."
            )
    cfg.model.validate()
    check_paths(cfg)
    t, data, attention = cfg.train, cfg.data, cfg.model.attention
    if getattr(t, "seq_len", 0) > cfg.model.max_seq_len:
        raise ConfigError(
            f"train.seq_len={t.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}; "
            "lower train.seq_len or raise model.max_seq_len."
        )
    if t.batch_size % t.grad_accum:
        raise ConfigError(
            f"train.batch_size={t.batch_size} is not divisible by train.grad_accum={t.grad_accum}; "
            "each microbatch must have the same size."
        )
    # chat's conversations are asked for when training reads them: an imported run's config leaves them to set
    if data.source in DATA_FOLDERS and not data.path and data.format != "chat":
        raise ConfigError(f"data.source={data.source} needs data.path={DATA_FOLDERS[data.source]}.")
    if data.source == "pydoc" and data.path:
        raise ConfigError(
            f"data.path={data.path} is set, but data.source=pydoc reads the built-in text; set data.source=tokens "
            "(shards from `podtrain data prepare`) or text (a local corpus)."
        )
    if attention == "splash" and getattr(t, "seq_len", 1) % SPLASH_BLOCK:
        raise ConfigError(
            f"model.attention=splash runs blocks of {SPLASH_BLOCK} positions: make train.seq_len a multiple of "
            f"{SPLASH_BLOCK} (puzzles are not), or use model.attention=xla."
        )
    packed_apart = (
        "data.pack=documents" if data.pack == "documents" else "data.format=chat" if data.format == "chat" else ""
    )
    if packed_apart and attention == "cudnn":
        raise ConfigError(
            f"{packed_apart} keeps attention inside documents by their segment ids, which cuDNN's fused attention "
            "does not take; use model.attention=xla (or auto, which does), or data.pack=concat."
        )
    if data.reset_positions and not packed_apart:
        raise ConfigError(
            "data.reset_positions=true restarts positions at each packed document, and data.pack=concat packs none "
            "apart; set data.pack=documents (or data.format=chat), or data.reset_positions=false."
        )
    if data.format in ("chat", "pairs") and data.source != "text":
        raise ConfigError(
            f"data.format={data.format} reads {'conversations' if data.format == 'chat' else 'preference pairs'} from "
            f"a JSONL file or folder: set data.source=text and data.path=FILE_OR_DIR (not data.source={data.source})."
        )
    if (getattr(t, "objective", "lm") == "dpo") != (data.format == "pairs"):
        raise ConfigError(
            "train.objective=dpo learns from preference pairs: set data.format=pairs too (JSONL lines of "
            '{"prompt", "chosen", "rejected"})."'
            if data.format != "pairs"
            else "data.format=pairs holds preference pairs, which only train.objective=dpo learns from: set "
            "train.objective=dpo (or data.format=chat to fine-tune on conversations)."
        )
    if cfg.mesh.context != 1 and attention == "cudnn":
        raise ConfigError(
            f"mesh.context={cfg.mesh.context} splits the sequence, which cuDNN's fused attention cannot attend "
            "across; use model.attention=xla (or auto, which does on a GPU), or mesh.context=1."
        )
    split = max(cfg.mesh.context, 1)
    if attention == "splash" and cfg.mesh.context != 1 and getattr(cfg.model, "context_attention", "") == "ring":
        raise ConfigError(
            "model.context_attention=ring passes keys round the context shards in XLA operations; the splash "
            "kernel gathers them (all_gather). Use model.attention=xla (or auto) with ring, or all_gather with splash."
        )
    if attention == "splash" and split > 1 and getattr(t, "seq_len", 1) % (SPLASH_BLOCK * split):
        raise ConfigError(
            f"model.attention=splash with mesh.context={split} gives each shard whole blocks of {SPLASH_BLOCK} "
            f"queries: make train.seq_len a multiple of {SPLASH_BLOCK * split}, or use model.attention=xla."
        )
    if attention == "cudnn" and (lacking := cudnn_lacks(cfg.model)):
        raise ConfigError(
            f"{' and '.join(lacking)}: cuDNN's fused attention takes no sliding window or soft-cap; use "
            "model.attention=xla (or auto)."
        )
    experts = getattr(cfg.model, "experts", 0)
    if cfg.mesh.expert > 1 and (not experts or experts % cfg.mesh.expert):
        having = f"model.experts={experts}" if experts else f"model.name={cfg.model.name}, which has no experts"
        raise ConfigError(
            f"mesh.expert={cfg.mesh.expert} splits an MoE layer's experts evenly over its devices, and {having}; "
            "give mesh.expert a divisor of the experts, or put those devices on mesh.data."
        )
    _check_pipeline(cfg)
    profile = t.profile_steps
    if profile and not (len(profile) == 2 and 1 <= profile[0] <= profile[1]):
        raise ConfigError(
            f"train.profile_steps={profile} is not [START, END] with 1 <= START <= END; e.g. "
            "train.profile_steps=[10,12] traces steps 10 to 12."
        )
    if "wandb" in cfg.log.to and not _installed("wandb"):
        raise ConfigError(
            "log.to has wandb, which is not installed: pip install -e '.[wandb]' (or pip install wandb), "
            "or leave wandb out of log.to."
        )


def cudnn_lacks(model) -> list[str]:
    """The options of a model that cuDNN's fused attention does not compute (as key=value)."""
    return [f"model.{k}={getattr(model, k)}" for k in ("sliding_window", "attn_softcap") if getattr(model, k, 0)]


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # in sys.modules without a spec: blocked, as a test does to stand for its absence
        return False


PIPELINED = ("llama", "mhc")  # the families whose one stack of layers runs as a pipeline


def _check_pipeline(cfg: Config) -> None:
    """Stages (x repeats) that cut the layers evenly, at least as many microbatches, each splitting evenly."""
    if cfg.mesh.stage == 1 and cfg.mesh.dcn_stage == 1:
        return
    stages = max(cfg.mesh.stage, 1) * max(cfg.mesh.dcn_stage, 1)  # a -1 is checked against the devices
    name, layers = cfg.model.name, getattr(cfg.model, "n_layers", 0)
    if name not in PIPELINED or cfg.mesh.context != 1:
        raise ConfigError(
            f"mesh.stage={cfg.mesh.stage} (dcn_stage={cfg.mesh.dcn_stage}) pipelines the layers of "
            f"{' or '.join(PIPELINED)} models with mesh.context=1; this is model.name={name}, mesh.context="
            f"{cfg.mesh.context}. Put those devices on mesh.data or mesh.fsdp."
        )
    repeats, circular = cfg.pipeline.repeats, cfg.pipeline.schedule == "circular"
    if circular != (repeats > 1):
        raise ConfigError(
            f"pipeline.schedule={cfg.pipeline.schedule} with pipeline.repeats={repeats}: the circular schedule "
            "goes round the stages 2 or more times (set pipeline.repeats), gpipe once (pipeline.repeats=1)."
        )
    if layers % (stages * repeats):
        raise ConfigError(
            f"model.n_layers={layers} does not cut evenly into {stages} pipeline stages (mesh.stage x "
            f"mesh.dcn_stage) x {repeats} pipeline.repeats; give sizes whose product divides the layers."
        )
    micro, batch = cfg.pipeline.microbatches or stages, cfg.train.batch_size // cfg.train.grad_accum
    if micro < stages or batch % micro:
        raise ConfigError(
            f"pipeline.microbatches={micro} must be at least the {stages} stages (else some stage idles every "
            f"tick) and divide the microbatch of {batch} sequences (train.batch_size / train.grad_accum)."
        )


def resolve_auto(cfg: Config, platform: str) -> Config:
    """Replace the `auto` settings by what suits the platform (bar a GPU's scan_unroll)."""
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model))
    m = cfg.model
    if m.compute_dtype == "auto":
        m.compute_dtype = "float32" if platform == "cpu" else "bfloat16"
    if m.attention == "auto":
        # cuDNN's fused attention wants 16-bit inputs and head_dim <= 128 in multiples of 8.
        head_dim = getattr(m, "head_dim", 0) or m.d_model // m.n_heads
        cudnn_ok = platform == "gpu" and m.compute_dtype == "bfloat16" and head_dim <= 128 and head_dim % 8 == 0
        splash_ok = platform == "tpu" and getattr(cfg.train, "seq_len", 1) % SPLASH_BLOCK == 0  # whole blocks
        split = max(cfg.mesh.context, 1)
        splash_ok = splash_ok and getattr(cfg.train, "seq_len", 1) % (SPLASH_BLOCK * split) == 0
        splash_ok = splash_ok and not (split > 1 and getattr(m, "context_attention", "") == "ring")
        fused = "cudnn" if cudnn_ok and cfg.mesh.context == 1 else "splash" if splash_ok else "xla"
        if fused == "cudnn" and (cudnn_lacks(m) or cfg.data.pack == "documents" or cfg.data.format == "chat"):
            fused = "xla"  # what cuDNN's kernel cannot keep apart
        m.attention = fused
    if getattr(m, "mlp_kernel", None) == "auto":
        m.mlp_kernel = "pallas" if platform == "tpu" else "xla"
    if getattr(m, "expert_kernel", None) == "auto":
        m.expert_kernel = "megablox" if platform == "tpu" else "ragged_dot"
    if m.scan_unroll == "auto" and platform != "gpu":  # on a GPU the compiled step decides: fit.choose_unroll
        m.scan_unroll = 1
    return cfg
