"""`podtrain data prepare`: tokenize a corpus once into the shards of `podtrain.data.tokens`.

Documents are read in order and cut into shards of `shard_docs` documents; each shard's files are
written under temporary names, renamed, and then recorded by a small SHARD.json, so a prepare that
is interrupted keeps its finished shards and a rerun continues after them. Document i goes to
validation when floor((i + 1) x) > floor(i x) for the validation fraction x: spread evenly over the
corpus and decided without knowing its length, as a streamed hub dataset requires.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import math
import time
from pathlib import Path

import numpy as np
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from podtrain import storage
from podtrain.data.sources import Corpus
from podtrain.data.tokenizer import keep_tokenizer
from podtrain.data.tokens import FORMAT, MANIFEST, shard_file
from podtrain.errors import DataError

SHARD_DOCS = 20_000  # documents per shard: the work an interrupted prepare can lose
BATCH_DOCS = 512  # documents per call of the (parallel) batch encoder


def is_validation(i: int, fraction: float) -> bool:
    return math.floor((i + 1) * fraction) > math.floor(i * fraction)


def _write_json(path: Path, value: dict) -> None:
    storage.write_text(path, json.dumps(value, indent=1) + "\n")


def _settings(corpus: Corpus, tokenizer, val_fraction: float, shard_docs: int) -> dict:
    return {
        "format": FORMAT,
        "corpus": dataclasses.asdict(corpus),
        "tokenizer": {
            "spec": tokenizer.spec,
            "sha256": tokenizer.identity,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
        },
        "val_fraction": val_fraction,
        "shard_docs": shard_docs,
        "dtype": "uint16" if tokenizer.vocab_size <= 1 << 16 else "uint32",
    }


def _start(out: Path, settings: dict) -> list[dict]:
    """The shards already finished in `out` by a prepare with the same settings."""
    recorded = out / "prepare.json"
    if recorded.is_file():
        if json.loads(recorded.read_text()) != settings:
            raise DataError(
                f"{out} holds shards prepared with other settings (corpus, tokenizer, --val-fraction); "
                f"use a new --out, or delete {out} to start over."
            )
    elif out.exists() and any(out.iterdir()):
        raise DataError(f"--out {out} is a folder with other files in it; give a new or empty folder.")
    _write_json(recorded, settings)
    done = []
    while (record := out / f"shard-{len(done):05d}.json").is_file():
        done.append(json.loads(record.read_text()))
    return done


def _write_shard(
    out: Path, index: int, dtype: str, texts: list[str], first_doc: int, tokenizer, val_fraction: float
) -> dict:
    tokens = {"train": [], "val": []}
    eos = [tokenizer.eos_id]
    for start in range(0, len(texts), BATCH_DOCS):
        for offset, ids in enumerate(tokenizer.encode_batch(texts[start : start + BATCH_DOCS])):
            if ids:
                tokens["val" if is_validation(first_doc + start + offset, val_fraction) else "train"] += [ids, eos]
    record = {"index": index, "documents": len(texts), "empty_documents": sum(not t for t in texts)}
    for split, pieces in tokens.items():
        array = np.concatenate(pieces).astype(dtype) if pieces else np.zeros(0, dtype)
        buffer = io.BytesIO()
        np.save(buffer, array)
        storage.write_bytes(shard_file(out, split, index), buffer.getvalue())
        record[f"{split}_tokens"] = len(array)
        record[f"{split}_max_id"] = int(array.max()) if len(array) else -1
    _write_json(out / f"shard-{index:05d}.json", record)
    return record


def _check(tokenizer, val_fraction: float) -> None:
    if tokenizer.eos_id is None:
        raise DataError(
            f"The tokenizer {tokenizer.spec} has no end-of-document token to join documents with; use one that has (a "
            "fitted BPE, a Hugging Face model's)."
        )
    if not 0 <= val_fraction < 1:
        raise DataError(f"--val-fraction {val_fraction} is outside [0, 1); give e.g. 0.01.")


def prepare(
    corpus: Corpus,
    tokenizer,
    out: str | Path,
    val_fraction: float = 0.01,
    shard_docs: int = SHARD_DOCS,
    quiet: bool = False,
) -> dict:
    """Tokenize `corpus` into shards in `out` (a local folder or a bucket's), continuing an
    interrupted prepare; returns the manifest."""
    _check(tokenizer, val_fraction)
    out = storage.path(out)
    storage.makedirs(out)
    settings = _settings(corpus, tokenizer, val_fraction, shard_docs)
    if (out / MANIFEST).is_file() and json.loads((out / "prepare.json").read_text()) == settings:
        return json.loads((out / MANIFEST).read_text())
    shards = _start(out, settings)
    documents = itertools.islice(corpus.documents(), len(shards) * shard_docs, None)
    columns = [
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TextColumn("{task.fields[rates]}"),
        TimeElapsedColumn(),
    ]
    clock, docs, tokens = time.perf_counter(), 0, 0
    with Progress(*columns, disable=quiet, transient=False) as progress:
        bar = progress.add_task("", rates="", total=None)
        while texts := list(itertools.islice(documents, shard_docs)):
            shards.append(
                _write_shard(
                    out, len(shards), settings["dtype"], texts, len(shards) * shard_docs, tokenizer, val_fraction
                )
            )
            docs, tokens = docs + len(texts), tokens + shards[-1]["train_tokens"] + shards[-1]["val_tokens"]
            elapsed = time.perf_counter() - clock
            progress.update(
                bar,
                description=f"shard {len(shards)}: {docs:,} documents, {tokens:,} tokens",
                rates=f"{docs / elapsed:,.0f} docs/s  {tokens / elapsed:,.0f} tokens/s",
            )
    totals = {
        key: sum(s[key] for s in shards) for key in ("documents", "empty_documents", "train_tokens", "val_tokens")
    }
    if not totals["train_tokens"]:
        raise DataError(
            f"The corpus {corpus.input} has no text to train on ({totals['documents']} documents, all empty or all "
            "validation); check --input and --text-field."
        )
    if tokenizer.file is not None:
        keep_tokenizer(tokenizer, out / "tokenizer")
    manifest = {
        **settings,
        **totals,
        "max_id": max(max(s["train_max_id"], s["val_max_id"]) for s in shards),
        "shards": shards,
    }
    _write_json(out / MANIFEST, manifest)
    return {**manifest, "tokens_per_sec": tokens / (time.perf_counter() - clock) if tokens else None}
