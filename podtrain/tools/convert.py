"""`podtrain convert`: a Hugging Face checkpoint (interop/hf/families.py) into a podtrain run directory, and back."""

from __future__ import annotations

import json
import time

import jax.numpy as jnp

from podtrain import runtime, storage
from podtrain.config.schema import Config
from podtrain.data.chat import stop_ids, template_of
from podtrain.data.tokenizer import GENERATION, keep_tokenizer, load_tokenizer
from podtrain.errors import ConfigError
from podtrain.interop.hf import peft
from podtrain.interop.hf.checkpoint import hf_folder, read_hf_config, read_params, write_params
from podtrain.interop.hf.config_json import export_family, hf_config, model_keys
from podtrain.interop.hf.families import FAMILIES, tensor_layout
from podtrain.program import adapters
from podtrain.program.load import default_config, load_config
from podtrain.program.prepare import final
from podtrain.program.saved import config_file
from podtrain.program.state import model_fns
from podtrain.train.checkpoint import Checkpointer
from podtrain.train.run import Run

IMPORTED = "imported.json"  # RUN_DIR/imported.json: where `convert --from-hf` read the weights, and their dtype
# An imported model is there to be fine-tuned: a rate and decay that keep what it knows, the user's
# conversations (data.path, left to set), and a sample at the end that is a reply, not 200 tokens of text.
FINE_TUNING = (
    "train.lr=1e-5",
    "train.weight_decay=0.0",
    "train.sample_tokens=64",
    "data.source=text",
    "data.format=chat",
)
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def import_hf(source: str, run_dir: str, overrides: list[str]) -> tuple[Config, float]:
    """RUN_DIR/config.yaml with the checkpoint's model keys, fine-tuning's train and data keys (and
    `overrides`), its tokenizer and generation config in RUN_DIR/tokenizer, and its weights as a step-0
    checkpoint of weights alone, which `train` fine-tunes with a fresh optimizer and `generate`
    samples from. Returns the config and the seconds spent reading the weights."""
    folder = hf_folder(source)
    run = storage.path(run_dir)
    if (run / "checkpoints").exists() or config_file(run).exists():
        raise ConfigError(f"{run_dir} already holds a run; give a new RUN_DIR to convert into.")
    has_tokenizer = (folder / "tokenizer.json").is_file()
    hf = read_hf_config(folder)
    keys = model_keys(hf, source)
    seq_len = min(default_config("llama").train.seq_len, keys["max_seq_len"])  # where the positions allow it
    # the run's copy, named as RUN_DIR was given: the config moves with the run as run_dir does
    tokenizer = [f"data.tokenizer={run_dir.rstrip('/')}/{Run.TOKENIZER}"] if has_tokenizer else []
    cfg = load_config(
        None,
        [
            *(f"model.{k}={v}" for k, v in keys.items()),
            f"train.seq_len={seq_len}",
            *FINE_TUNING,
            *tokenizer,
            f"run_dir={run_dir}",
            *overrides,
        ],
    )
    rt = runtime.start(cfg, announce=False)
    resolved = final(cfg, rt.platform, rt.mesh, compiles=False)
    fns = model_fns(resolved, rt.mesh)
    start = time.perf_counter()
    table, elsewhere = tensor_layout(hf)
    params = read_params(folder, fns.abstract_params, table, source, elsewhere)
    seconds = time.perf_counter() - start
    if rt.is_main and hf.get("num_nextn_predict_layers"):
        print(
            f"[podtrain] {source}: num_nextn_predict_layers={hf['num_nextn_predict_layers']} (DeepSeek's multi-token "
            "prediction) is ignored: podtrain, as transformers, predicts the next token only, and imports no "
            "tensors of those layers."
        )
    if rt.is_main:  # `auto` precision kept: resolved on the machine that trains
        Run.of(cfg).keep(cfg, load_tokenizer(str(folder)) if has_tokenizer else None)
        if has_tokenizer and (generation := _generation(folder, hf)):
            (run / Run.TOKENIZER / GENERATION).write_text(json.dumps(generation, indent=1))
        origin = {"source": source, "dtype": hf.get("torch_dtype") or hf.get("dtype") or "float32"}
        (run / IMPORTED).write_text(json.dumps(origin, indent=1))
    checkpointer = Checkpointer(cfg.checkpoint_dir, async_save=False)
    checkpointer.save({"step": jnp.int32(0), "params": params})
    checkpointer.close()
    return cfg, seconds


def _generation(folder, hf: dict) -> dict:
    """The source's generation_config.json, else the token ids of its config.json (from which
    transformers derives one): what the export gives back."""
    if (folder / GENERATION).is_file():
        return json.loads((folder / GENERATION).read_text())
    ids = {**{k: v for k, v in (hf.get("text_config") or {}).items() if k in TOKEN_IDS}, **hf}
    return {k: ids[k] for k in TOKEN_IDS if ids.get(k) is not None}


def generation_config(tokenizer) -> dict:
    """generation_config.json of an export: the run's tokenizer's (an imported model's, sampling
    defaults included) with bos and pad as they were (bos: the EOS where none was given) and the
    stop tokens of `stop_ids` (its eos list, plus the chat template's end of turn) as eos."""
    kept = {k: v for k, v in tokenizer.generation.items() if k not in ("transformers_version", "_from_model_config")}
    stops = stop_ids(tokenizer)
    return {
        **kept,
        "bos_token_id": kept.get("bos_token_id", tokenizer.eos_id),
        "eos_token_id": stops[0] if len(stops) == 1 else stops or None,
        "pad_token_id": kept.get("pad_token_id"),
    }


def export_dtype(run_dir: str) -> str:
    """The dtype an export writes by default: the one the run was imported in, else bfloat16."""
    imported = storage.path(run_dir) / IMPORTED
    return json.loads(imported.read_text())["dtype"] if imported.is_file() else "bfloat16"


def export_hf(run_dir: str, out_dir: str, dtype: str | None = None, adapter: bool = False) -> tuple[list[str], str]:
    """OUT_DIR with config.json, generation_config.json, the weights (the EMA where the run kept
    one; a LoRA run's merged into its base) as safetensors in `dtype` (default: `export_dtype`), and
    the run's tokenizer files when it used a Hugging Face tokenizer: what
    `transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)` loads. With `adapter`, a LoRA run's
    adapters alone, as PEFT loads them onto the base. Returns the files written and the dtype."""
    dtype = dtype or export_dtype(run_dir)
    run = Run.at(run_dir)
    cfg, _, params = run.language_model()
    exported = dict.fromkeys(f.model_name for f in FAMILIES.values())
    if cfg.model.name not in exported:
        raise ConfigError(
            f"{run_dir} trained model.name={cfg.model.name}; only {' and '.join(exported)} have Hugging Face "
            f"architectures (model_type {', '.join(FAMILIES)}) to export to."
        )
    family = export_family(cfg.model)
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"--dtype {dtype} is not one of float32, bfloat16, float16.")
    if adapter:
        with storage.staged(out_dir, last=(peft.CONFIG,)) as out:
            return peft.write_adapter(params, cfg, family.tensors, out, dtype), dtype
    if cfg.train.lora.rank:
        params = adapters.merged(params, cfg.train.lora.alpha / cfg.train.lora.rank)
    tokenizer = run.tokenizer()
    generation = generation_config(tokenizer)
    with storage.staged(out_dir, last=("config.json",)) as out:
        files = write_params(params, out, family.tensors, dtype)
        if tokenizer.file:
            keep_tokenizer(tokenizer, out)
        ids = {k: generation[k] for k in TOKEN_IDS}
        (out / "config.json").write_text(json.dumps(hf_config(cfg.model, ids, dtype), indent=2))
        (out / GENERATION).write_text(json.dumps(generation, indent=2))
    return files, dtype


def command(args) -> None:
    """`podtrain convert --from-hf SRC RUN_DIR [overrides]` or `--to-hf RUN_DIR OUT_DIR`, with what to do next."""
    if args.from_hf:
        source, run_dir = args.from_hf
        cfg, seconds = import_hf(source, run_dir, args.overrides)
        print(
            f"[podtrain] {run_dir}: {cfg.model.name} with {cfg.model.n_layers} layers, d_model "
            f"{cfg.model.d_model}, vocab {cfg.model.vocab_size}, weights read in {seconds:.1f} s.\n{_next(cfg)}"
        )
    else:
        if args.overrides:
            raise ConfigError(
                f"--to-hf takes no key=value overrides (got {' '.join(args.overrides)}); the run's config.yaml decides."
            )
        run_dir, out = args.to_hf
        files, dtype = export_hf(run_dir, out, args.dtype, args.adapter)
        if args.adapter:
            print(
                f"[podtrain] wrote {out}: {', '.join(files)}; load them with "
                f"peft.PeftModel.from_pretrained(BASE_MODEL, {out!r})."
            )
            return
        print(
            f"[podtrain] wrote {out}: config.json, {', '.join(files)} in {dtype}; load it with "
            f"transformers.AutoModelForCausalLM.from_pretrained({out!r})."
        )


def _next(cfg: Config) -> str:
    """What to do with an imported run: chat fine-tuning where its tokenizer has a chat template."""
    run_dir, tokenizer = cfg.run_dir, Run.of(cfg).tokenizer()
    if template_of(tokenizer):
        return (
            f'[podtrain] fine-tune it on your conversations (JSONL lines of {{"messages": [...]}}, '
            f"lr {cfg.train.lr:g}):\n  podtrain train {run_dir}/config.yaml data.path=CHATS.jsonl "
            f"run_dir={run_dir}-chat train.init_from={run_dir}\n"
            f'[podtrain] chat with it: podtrain generate {run_dir} --chat "Hello!"'
        )
    return (
        f"[podtrain] its tokenizer has no chat template: fine-tune on conversations with data.tokenizer= an "
        f"instruction-tuned model's, or go on pretraining with `podtrain train {run_dir}/config.yaml "
        f"data.format=text data.path=CORPUS run_dir={run_dir}-more train.init_from={run_dir}`; sample with "
        f"`podtrain generate {run_dir} --prompt TEXT`."
    )
