"""The text a language model trains on, by the kind of its source (podtrain.data.registry): the
tokenizer a config names and the (train, val) tokens of the docs every CPython ships or of a local
corpus, tokenized in memory, or of shards prepared by `podtrain data prepare`, memory-mapped."""

from __future__ import annotations

import numpy as np

from podtrain import storage
from podtrain.config.schema import DataConfig
from podtrain.data.sources import Corpus
from podtrain.data.tokenizer import BYTES, load_tokenizer
from podtrain.data.tokens import TokenStream, load_manifest
from podtrain.errors import DataError


def named_tokenizer(cfg: DataConfig):
    """data.tokenizer, `auto` being bytes."""
    return load_tokenizer(BYTES if cfg.tokenizer == "auto" else cfg.tokenizer)


def shards_tokenizer(cfg: DataConfig):
    """data.tokenizer, `auto` being the shards' own; an explicit tokenizer must be the one the shards were made with."""
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


def shard_tokens(cfg: DataConfig, tokenizer) -> tuple[TokenStream, TokenStream]:
    """The (train, val) TokenStreams of prepared shards, split by document."""
    manifest = load_manifest(cfg.path)
    if cfg.dataset_name and manifest["corpus"]["dataset_name"] != cfg.dataset_name:
        raise DataError(
            f"The shards in {cfg.path} were prepared from {manifest['corpus']['input']} config "
            f"{manifest['corpus']['dataset_name']}, not data.dataset_name={cfg.dataset_name}."
        )
    return TokenStream.of(cfg.path, manifest, "train"), TokenStream.of(cfg.path, manifest, "val")


def pydoc_tokens(cfg: DataConfig, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """The (train, val) tokens of the topic pages every CPython ships."""
    return _in_memory(Corpus("pydoc"), cfg, tokenizer)


def corpus_tokens(cfg: DataConfig, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """The (train, val) tokens of the corpus file or folder at data.path."""
    if not storage.path(cfg.path).exists():
        raise DataError(
            f"data.path={cfg.path} does not exist; give a corpus file or folder (.txt, .md, .jsonl, .json, .parquet)."
        )
    return _in_memory(Corpus(cfg.path), cfg, tokenizer)


def _in_memory(corpus: Corpus, cfg: DataConfig, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """The corpus's documents tokenized, split by position: the last val_fraction is validation."""
    tokens = np.asarray(tokenizer.encode("\n\n".join(corpus.documents())), dtype=np.int32)
    n_val = int(len(tokens) * cfg.val_fraction)
    return tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]


def tokenizer_max_id(cfg: DataConfig, tokenizer) -> int:
    """The largest token id text tokenized in memory can hold: the tokenizer's."""
    return tokenizer.vocab_size - 1


def shards_max_id(cfg: DataConfig, tokenizer) -> int:
    """The largest token id the shards hold, as their manifest records it."""
    return load_manifest(cfg.path)["max_id"]
