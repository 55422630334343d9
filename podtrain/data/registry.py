"""The data sources by `data.source`'s name: what each is, what data.path must name, the task that
trains on it and, for text, how its tokenizer and tokens are had; and the record of a `data.format`,
whose table (FORMATS) is the language task's, beside the code each names. The config's checks, the
tasks, `model.vocab_size=auto` and docs/configuration.md read these tables, so a source or a format
is one entry plus the code that reads it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from podtrain.config.schema import DataConfig
from podtrain.data import sudoku, text


@dataclass(frozen=True)
class Source:
    """One value of data.source: what it is and reads, the task that trains on it, and for text how
    its tokens are had."""

    doc: str  # what it is, for docs/configuration.md
    task: str  # the task that trains on it: its name in podtrain.program.tasks.registry.TASKS
    reads: str  # what it reads, as the errors say it (after "data.source=NAME reads ...")
    path: str = ""  # what data.path must name (FILE_OR_DIR, DIR); "": it takes no data.path
    # text: the tokenizer of the data config (its `auto` resolved), the (train, val) tokens, the largest token id
    tokenizer: Callable[[DataConfig], object] = text.named_tokenizer
    tokens: Callable[[DataConfig, object], tuple] | None = None
    max_id: Callable[[DataConfig, object], int] = text.tokenizer_max_id
    vocab: int = 0  # a fixed vocabulary, which model.vocab_size=auto cannot read from a tokenizer; 0: none


@dataclass(frozen=True)
class Format:
    """One value of data.format: what its rows hold, the sources and the objective it is for, and
    how the task reads and scores them."""

    doc: str  # for docs/configuration.md
    holds: str  # what it reads, as the errors say it (after "data.format=NAME reads ...")
    read: Callable  # (task, mesh) -> None: sets the task's summary, batches and eval_batches
    channels: tuple[int, ...] = ()  # a row's dimensions before its seq_len + 1 positions
    sequences: int = 1  # the sequences of seq_len a row trains, for tokens/s and MFU
    sources: tuple[str, ...] = ()  # the values of data.source it reads from; (): each its task reads
    objective: str = "lm"  # the train.objective that learns from it
    apart: bool = False  # its rows keep packed documents apart by segment ids, whatever data.pack
    path_on_read: bool = False  # data.path is asked for when training reads the data, not when the config loads
    losses: Callable | None = None  # config -> (loss_fn, eval_fn); None: the task's next-token loss, by data.pack


SOURCES: dict[str, Source] = {
    "pydoc": Source(
        "the English docs every CPython ships, tokenized in memory",
        "language",
        "the built-in text",
        tokens=text.pydoc_tokens,
    ),
    "text": Source(
        "a local corpus at data.path, tokenized in memory: the last data.val_fraction validates",
        "language",
        "a corpus file or folder of .txt, .md, .jsonl, .json or .parquet files",
        path="FILE_OR_DIR",
        tokens=text.corpus_tokens,
    ),
    "tokens": Source(
        "shards from `podtrain data prepare`, memory-mapped, with their own tokenizer and split",
        "language",
        "a folder made by `podtrain data prepare --out DIR`",
        path="DIR",
        tokenizer=text.shards_tokenizer,
        tokens=text.shard_tokens,
        max_id=text.shards_max_id,
    ),
    "sudoku": Source(
        "train and test puzzles from `podtrain data sudoku`",
        "puzzles",
        "a folder built by `podtrain data sudoku --out DIR`",
        path="DIR",
        vocab=sudoku.VOCAB,
    ),
}
