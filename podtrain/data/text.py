"""The text a language model trains on: the tokenizer a config names and the (train, val) tokens
of its source: the docs every CPython ships or a local corpus, tokenized in memory, or shards
prepared by `podtrain data prepare` (data.source=tokens), memory-mapped."""

from __future__ import annotations

import numpy as np

from podtrain import storage
from podtrain.config.schema import DataConfig
from podtrain.data.sources import Corpus
from podtrain.data.tokenizer import BYTES, load_tokenizer
from podtrain.data.tokens import TokenStream, load_manifest
from podtrain.errors import DataError


def data_tokenizer(cfg: DataConfig):
    """data.tokenizer; `auto` is the shards' own tokenizer for data.source=tokens and bytes otherwise.
    An explicit tokenizer must be the one the shards were made with."""
    if cfg.source != "tokens":
        return load_tokenizer(BYTES if cfg.tokenizer == "auto" else cfg.tokenizer)
    manifest = load_manifest(cfg.path)
    made_with = manifest["tokenizer"]
    tokenizer = load_tokenizer(storage.join(cfg.path, "tokenizer") if cfg.tokenizer == "auto" else cfg.tokenizer)
    if tokenizer.identity != made_with["sha256"]:
        raise DataError(
            f"The shards in {cfg.path} were made with the tokenizer {made_with['spec']} (sha256 "
            f"{made_with['sha256'][:12]}), not data.tokenizer={cfg.tokenizer} (sha256 {tokenizer.identity[:12]}). "
            "Leave data.tokenizer=auto to use theirs, or prepare the corpus with this tokenizer."
        )
    return tokenizer


def load_tokens(cfg: DataConfig, tokenizer) -> tuple:
    """(train, val) token sequences: numpy arrays, or TokenStreams of prepared shards. In-memory
    text is split by position, the last val_fraction being validation; shards by document."""
    if cfg.source == "tokens":
        manifest = load_manifest(cfg.path)
        if cfg.dataset_name and manifest["corpus"]["dataset_name"] != cfg.dataset_name:
            raise DataError(
                f"The shards in {cfg.path} were prepared from {manifest['corpus']['input']} config "
                f"{manifest['corpus']['dataset_name']}, not data.dataset_name={cfg.dataset_name}."
            )
        return TokenStream.of(cfg.path, manifest, "train"), TokenStream.of(cfg.path, manifest, "val")
    if cfg.source == "text" and not storage.path(cfg.path).exists():
        raise DataError(
            f"data.path={cfg.path} does not exist; give a corpus file or folder (.txt, .md, .jsonl, .json, .parquet)."
        )
    text = "\n\n".join(Corpus("pydoc" if cfg.source == "pydoc" else cfg.path).documents())
    tokens = np.asarray(tokenizer.encode(text), dtype=np.int32)
    n_val = int(len(tokens) * cfg.val_fraction)
    return tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]


def max_token_id(cfg: DataConfig, tokenizer) -> int:
    """The largest token id the data can hold: the shards' recorded maximum, or the tokenizer's."""
    return load_manifest(cfg.path)["max_id"] if cfg.source == "tokens" else tokenizer.vocab_size - 1
