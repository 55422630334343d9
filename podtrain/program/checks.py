"""Checks of a loaded config that need more than a type (ranges, relations between values), and
the `auto` values a platform resolves. `load.py` runs `validate` on every config it loads."""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.util

from podtrain import storage
from podtrain.config.keys import ranges
from podtrain.config.schema import Config
from podtrain.data.registry import SOURCES
from podtrain.errors import ConfigError, StorageError
from podtrain.interop.hf.families import model_types
from podtrain.models import MODELS
from podtrain.models.attention.context import STRATEGIES
from podtrain.models.attention.cores import CORES, PORTABLE, preferred
from podtrain.models.layers import REMAT_POLICIES
from podtrain.models.ops import PRECISIONS
from podtrain.program.optim import OPTIMIZERS
from podtrain.program.sinks import SINKS
from podtrain.program.tasks.language import FORMATS
from podtrain.sharding import microbatches_over


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


def switches() -> dict[str, tuple[str, ...]]:
    """Each key whose value names an entry of a registry (each item, for a list), with the names the
    registry holds now: the checks, the load's errors and the configuration page read them here."""
    return {
        "model.name": tuple(MODELS),
        "model.remat": tuple(REMAT_POLICIES),
        "model.attention": ("auto", *CORES),
        "model.matmul_precision": tuple(PRECISIONS),
        "train.optimizer": tuple(OPTIMIZERS),
        "context.strategy": tuple(STRATEGIES),
        "log.to": tuple(SINKS),
        "data.source": tuple(SOURCES),
        "data.format": tuple(FORMATS),
        "train.objective": tuple(dict.fromkeys(f.objective for f in FORMATS.values())),  # each a format's
    }


def validate(cfg: Config) -> None:
    """Checks that need more than a type: registered names, ranges and relations between values."""
    _check_switches(cfg)
    _check_ranges(cfg)
    cfg.model.validate()
    check_paths(cfg)
    for check in (
        _check_train,
        _check_data,
        _check_attention,
        _check_experts,
        _check_pipeline,
        _check_hf_type,
        _check_logging,
    ):
        check(cfg)


def changed(cfg: Config, changes: dict) -> Config:
    """A copy of `cfg` with dotted keys set, checked like a config file."""
    cfg = copy.deepcopy(cfg)
    for key, value in changes.items():
        *path, last = key.split(".")
        setattr(functools.reduce(getattr, path, cfg), last, value)
    validate(cfg)
    return cfg


def _check_hf_type(cfg: Config) -> None:
    """model.hf_type is a model_type of the families table that the model's family computes."""
    kinds = model_types(cfg.model.name)
    if kinds and cfg.model.hf_type not in kinds:
        raise ConfigError(
            f"model.hf_type={cfg.model.hf_type!r} is not a Hugging Face model_type that model.name={cfg.model.name} "
            f"computes; choose one of: {', '.join(kinds)}."
        )


def _check_switches(cfg: Config) -> None:
    for name, choices in switches().items():
        section, key = name.split(".")
        if not hasattr(getattr(cfg, section), key):  # a key of another family's task
            continue
        value = getattr(getattr(cfg, section), key)
        for item in value if isinstance(value, list) else [value]:
            if item not in choices:
                said = "has" if isinstance(value, list) else "is"
                raise ConfigError(f"Config key `{name}` {said} {item!r}; choose one of: {', '.join(choices)}.")


def _check_ranges(cfg: Config) -> None:
    for name, valid, value in ranges(cfg):
        if value not in valid:
            raise ConfigError(
                f"Config key `{name}` is {value!r}, outside its valid values: {valid}, finite. "
                "Give a value in that range; docs/configuration.md lists each key's."
            )


def _check_train(cfg: Config) -> None:
    t = cfg.train
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
    profile = t.profile_steps
    if profile and not (len(profile) == 2 and 1 <= profile[0] <= profile[1]):
        raise ConfigError(
            f"train.profile_steps={profile} is not [START, END] with 1 <= START <= END; e.g. "
            "train.profile_steps=[10,12] traces steps 10 to 12."
        )


def _check_data(cfg: Config) -> None:
    """Where the data is, in what form, for which objective, by the records of its source and format."""
    t, data = cfg.train, cfg.data
    source, form = SOURCES[data.source], FORMATS[data.format]
    if source.path and not data.path and not form.path_on_read:
        raise ConfigError(f"data.source={data.source} needs data.path={source.path}, {source.reads}.")
    if data.path and not source.path:
        others = [
            f"{name} ({other.reads})" for name, other in SOURCES.items() if other.path and other.task == source.task
        ]
        raise ConfigError(
            f"data.path={data.path} is set, but data.source={data.source} reads {source.reads}; set data.source="
            f"{' or '.join(others)}."
        )
    if form.sources and data.source not in form.sources:
        raise ConfigError(
            f"data.format={data.format} reads {form.holds}: set data.source={' or '.join(form.sources)} and "
            f"data.path={SOURCES[form.sources[0]].path} (not data.source={data.source})."
        )
    objective = getattr(t, "objective", "lm")
    if form.objective != objective:
        takes = " or ".join(name for name, other in FORMATS.items() if other.objective == objective)
        raise ConfigError(
            f"train.objective={objective} learns from data.format={takes}, and data.format={data.format} holds "
            f"{form.holds} for train.objective={form.objective}: set data.format={takes} too, or set "
            f"train.objective={form.objective}."
        )


def _packed_apart(cfg: Config) -> str:
    """The key that keeps packed documents apart by segment ids, or ''."""
    data = cfg.data
    if data.pack == "documents":
        return "data.pack=documents"
    return f"data.format={data.format}" if FORMATS[data.format].apart else ""


def attention_refusal(cfg: Config, kernel: str) -> str | None:
    """Why attention core `kernel` cannot compute cfg's attention, by what its record
    (models/attention/cores.py) takes, as the error that says so, or None: the checks and the
    `auto` choice both ask."""
    m, core = cfg.model, CORES.get(kernel)  # None: auto, whose choice falls back where a core refuses
    seq, split = getattr(cfg.train, "seq_len", 1), max(cfg.mesh.context, 1)
    strategy = cfg.context.strategy
    if getattr(m, "attention_kind", "gqa") == "mla" and ((core and not core.value_width) or split > 1):
        return (
            f"model.attention_kind=mla runs on the xla or splash attention over a whole sequence (model.attention="
            f"{kernel}, mesh.context={cfg.mesh.context}); use model.attention=xla, splash or auto, and mesh.context=1."
        )
    if core is None:
        return None
    if split > 1 and strategy not in core.context:
        return (
            f"mesh.context={cfg.mesh.context} splits the sequence, which {core.label} cannot attend across"
            + (f" under context.strategy={strategy}" if core.context else "")
            + "; use model.attention=xla (or auto)"
            + (f", or context.strategy={core.context[0]}." if core.context else ", or mesh.context=1.")
        )
    if seq % (core.block * split):
        return (
            f"model.attention={kernel} runs blocks of {core.block} positions on each of mesh.context={split} "
            f"shards: make train.seq_len a multiple of {core.block * split} (puzzles are not), or use "
            "model.attention=xla."
        )
    if not core.segments and (packed_apart := _packed_apart(cfg)):
        return (
            f"{packed_apart} keeps attention inside documents by their segment ids, which {core.label} "
            "does not take; use model.attention=xla (or auto, which does), or data.pack=concat."
        )
    options = (("sliding_window", core.windows, "sliding window"), ("attn_softcap", core.softcap, "soft-cap"))
    if lacking := [
        (f"model.{k}={getattr(m, k)}", what) for k, taken, what in options if not taken and getattr(m, k, 0)
    ]:
        keys, what = " and ".join(k for k, _ in lacking), " or ".join(w for _, w in lacking)
        return f"{keys}: {core.label} takes no {what}; use model.attention=xla (or auto)."
    return None


def _check_attention(cfg: Config) -> None:
    if refusal := attention_refusal(cfg, cfg.model.attention):
        raise ConfigError(refusal)
    if cfg.data.reset_positions and not _packed_apart(cfg):
        raise ConfigError(
            "data.reset_positions=true restarts positions at each packed document, and data.pack=concat packs none "
            "apart; set data.pack=documents (or data.format=chat), or data.reset_positions=false."
        )


def _check_experts(cfg: Config) -> None:
    experts = getattr(cfg.model, "experts", 0)
    if cfg.mesh.expert > 1 and (not experts or experts % cfg.mesh.expert):
        having = f"model.experts={experts}" if experts else f"model.name={cfg.model.name}, which has no experts"
        raise ConfigError(
            f"mesh.expert={cfg.mesh.expert} splits an MoE layer's experts evenly over its devices, and {having}; "
            "give mesh.expert a divisor of the experts, or put those devices on mesh.data."
        )


def _check_logging(cfg: Config) -> None:
    for name in cfg.log.to:
        if (extra := SINKS[name].extra) and not _installed(extra):
            raise ConfigError(
                f"log.to has {name}, whose package {extra} is not installed: pip install -e '.[{extra}]' (or pip "
                f"install {extra}), or leave {name} out of log.to."
            )


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # in sys.modules without a spec: blocked, as a test does to stand for its absence
        return False


def _check_pipeline(cfg: Config) -> None:
    """Stages (x repeats) that cut each stack of layers evenly, at least as many microbatches, each
    splitting the training batch evenly: the pipeline runs no batch another way."""
    if cfg.mesh.stage == 1 and cfg.mesh.dcn_stage == 1:
        return
    stages = max(cfg.mesh.stage, 1) * max(cfg.mesh.dcn_stage, 1)  # a -1 is checked against the devices
    name, family = cfg.model.name, MODELS[cfg.model.name]
    if family.recurrent or cfg.mesh.context != 1:
        pipelined = [f.name for f in MODELS.values() if not f.recurrent]
        raise ConfigError(
            f"mesh.stage={cfg.mesh.stage} (dcn_stage={cfg.mesh.dcn_stage}) pipelines the layers of "
            f"{' or '.join(pipelined)} models with mesh.context=1; this is model.name={name}"
            f"{' (its layers run inside a recurrence)' if family.recurrent else ''}, mesh.context={cfg.mesh.context}. "
            "Put those devices on mesh.data or mesh.fsdp."
        )
    repeats, circular = cfg.pipeline.repeats, cfg.pipeline.schedule == "circular"
    if circular != (repeats > 1):
        raise ConfigError(
            f"pipeline.schedule={cfg.pipeline.schedule} with pipeline.repeats={repeats}: the circular schedule "
            "goes round the stages 2 or more times (set pipeline.repeats), gpipe once (pipeline.repeats=1)."
        )
    lengths = cfg.model.stack_lengths() if hasattr(cfg.model, "stack_lengths") else (cfg.model.n_layers,)
    if any(n % (stages * repeats) for n in lengths):
        stacks = f"model.n_layers={cfg.model.n_layers}"
        if len(lengths) > 1:
            stacks += f" (stacks of {' and '.join(map(str, lengths))} layers: see model.first_dense_layers)"
        raise ConfigError(
            f"{stacks} does not cut evenly into {stages} pipeline stages (mesh.stage x mesh.dcn_stage) x "
            f"{repeats} pipeline.repeats; give sizes whose product divides the layers of each stack."
        )
    micro, batch = microbatches_over(stages, cfg.pipeline.microbatches), cfg.train.batch_size // cfg.train.grad_accum
    if micro < stages or batch % micro:
        raise ConfigError(
            f"pipeline.microbatches={micro} must be at least the {stages} stages (else some stage idles every "
            f"tick) and divide the {batch} sequences of each step's microbatch (train.batch_size="
            f"{cfg.train.batch_size} / train.grad_accum={cfg.train.grad_accum}); the pipeline runs no batch another "
            f"way: set pipeline.microbatches to a divisor of {batch} (at least {stages}), or train.batch_size to "
            f"train.grad_accum x a multiple of {micro}."
        )


def resolve_auto(cfg: Config, platform: str) -> Config:
    """Replace the `auto` settings by what suits the platform (bar a GPU's scan_unroll)."""
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model))
    m = cfg.model
    if m.compute_dtype == "auto":
        m.compute_dtype = "float32" if platform == "cpu" else "bfloat16"
    if m.attention == "auto":
        head_dim = getattr(m, "head_dim", 0) or m.d_model // m.n_heads
        fused = preferred(platform, m.compute_dtype, head_dim).name
        m.attention = PORTABLE if attention_refusal(cfg, fused) else fused
    if getattr(m, "mlp_kernel", None) == "auto":
        m.mlp_kernel = "pallas" if platform == "tpu" else "xla"
    if getattr(m, "expert_kernel", None) == "auto":
        m.expert_kernel = "megablox" if platform == "tpu" else "ragged_dot"
    if m.scan_unroll == "auto" and platform != "gpu":  # on a GPU the compiled step decides: prepare
        m.scan_unroll = 1
    return cfg
