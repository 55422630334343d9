"""`podtrain convert`: a Hugging Face checkpoint (interop/hf/families.py) into a podtrain run directory, and back."""

from __future__ import annotations

import json
import time

import jax.numpy as jnp

from podtrain import storage
from podtrain.config.load import default_config, load_config
from podtrain.config.schema import Config
from podtrain.data.tokenizer import keep_tokenizer, load_tokenizer
from podtrain.errors import ConfigError
from podtrain.interop.hf.checkpoint import hf_folder, read_hf_config, read_params, write_params
from podtrain.interop.hf.config_json import export_family, hf_config, model_keys
from podtrain.interop.hf.families import FAMILIES, tensor_layout
from podtrain.train.checkpoint import Checkpointer
from podtrain.train.run import Run, on_this_machine
from podtrain.train.state import model_fns

IMPORTED = "imported.json"  # RUN_DIR/imported.json: where `convert --from-hf` read the weights, and their dtype


def import_hf(source: str, run_dir: str, overrides: list[str]) -> tuple[Config, float]:
    """RUN_DIR/config.yaml with the checkpoint's model keys (and `overrides`), its tokenizer in
    RUN_DIR/tokenizer, and its weights as a step-0 checkpoint of weights alone, which `train`
    fine-tunes with a fresh optimizer and `generate` samples from. Returns the config and the
    seconds spent reading the weights."""
    folder = hf_folder(source)
    run = storage.path(run_dir)
    if (run / "checkpoints").exists() or (run / "config.yaml").exists():
        raise ConfigError(f"{run_dir} already holds a run; give a new RUN_DIR to convert into.")
    has_tokenizer = (folder / "tokenizer.json").is_file()
    hf = read_hf_config(folder)
    keys = model_keys(hf, source)
    seq_len = min(default_config("llama").train.seq_len, keys["max_seq_len"])  # where the positions allow it
    kept = str(run / Run.TOKENIZER) if storage.is_remote(run) else (run / Run.TOKENIZER).resolve()
    tokenizer = [f"data.tokenizer={kept}"] if has_tokenizer else []
    cfg = load_config(
        None,
        [
            *(f"model.{k}={v}" for k, v in keys.items()),
            f"train.seq_len={seq_len}",
            *tokenizer,
            f"run_dir={run_dir}",
            *overrides,
        ],
    )
    rt, resolved = on_this_machine(cfg, announce=False)
    fns = model_fns(resolved, rt.mesh)
    start = time.perf_counter()
    table, elsewhere = tensor_layout(hf)
    params = read_params(folder, fns.abstract_params, table, source, elsewhere)
    seconds = time.perf_counter() - start
    if rt.is_main:  # `auto` precision kept: resolved on the machine that trains
        Run.of(cfg).keep(cfg, load_tokenizer(str(folder)) if has_tokenizer else None)
        origin = {"source": source, "dtype": hf.get("torch_dtype") or hf.get("dtype") or "float32"}
        (run / IMPORTED).write_text(json.dumps(origin, indent=1))
    checkpointer = Checkpointer(cfg.checkpoint_dir, async_save=False)
    checkpointer.save({"step": jnp.int32(0), "params": params})
    checkpointer.close()
    return cfg, seconds


def export_dtype(run_dir: str) -> str:
    """The dtype an export writes by default: the one the run was imported in, else bfloat16."""
    imported = storage.path(run_dir) / IMPORTED
    return json.loads(imported.read_text())["dtype"] if imported.is_file() else "bfloat16"


def export_hf(run_dir: str, out_dir: str, dtype: str | None = None) -> tuple[list[str], str]:
    """OUT_DIR with config.json, generation_config.json, the weights (the EMA where the run kept
    one) as safetensors in `dtype` (default: `export_dtype`), and the run's tokenizer files when it
    used a Hugging Face tokenizer: what `transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)`
    loads. Returns the files written and the dtype."""
    dtype = dtype or export_dtype(run_dir)
    run = Run.at(run_dir)
    cfg, _, params = run.language_model()
    if cfg.model.name not in ("llama", "moe"):
        raise ConfigError(
            f"{run_dir} trained model.name={cfg.model.name}; only llama and moe have Hugging Face architectures "
            f"(model_type {', '.join(FAMILIES)}) to export to."
        )
    family = export_family(cfg.model)
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"--dtype {dtype} is not one of float32, bfloat16, float16.")
    tokenizer = run.tokenizer()
    with storage.staged(out_dir, last=("config.json",)) as out:
        files = write_params(params, out, family.tensors, dtype)
        (out / "config.json").write_text(json.dumps(hf_config(cfg.model, tokenizer.eos_id, dtype), indent=2))
        (out / "generation_config.json").write_text(
            json.dumps({"bos_token_id": tokenizer.eos_id, "eos_token_id": tokenizer.eos_id}, indent=2)
        )
        if tokenizer.file:
            keep_tokenizer(tokenizer, out)
    return files, dtype


def command(args) -> None:
    """`podtrain convert --from-hf SRC RUN_DIR [overrides]` or `--to-hf RUN_DIR OUT_DIR`, with what to do next."""
    if args.from_hf:
        source, run_dir = args.from_hf
        cfg, seconds = import_hf(source, run_dir, args.overrides)
        print(
            f"[podtrain] {run_dir}: {cfg.model.name} with {cfg.model.n_layers} layers, d_model "
            f"{cfg.model.d_model}, vocab {cfg.model.vocab_size}, weights read in {seconds:.1f} s. "
            f"Fine-tune with `podtrain train {run_dir}/config.yaml run_dir=NEW train.init_from={run_dir} ...`, "
            f"sample with `podtrain generate {run_dir}`."
        )
    else:
        if args.overrides:
            raise ConfigError(
                f"--to-hf takes no key=value overrides (got {' '.join(args.overrides)}); the run's config.yaml decides."
            )
        run_dir, out = args.to_hf
        files, dtype = export_hf(run_dir, out, args.dtype)
        print(
            f"[podtrain] wrote {out}: config.json, {', '.join(files)} in {dtype}; load it with "
            f"transformers.AutoModelForCausalLM.from_pretrained({out!r})."
        )
