"""Text sources as byte tokens (vocabulary 256): the docs every CPython ships, or local files."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from podtrain.config import DataConfig
from podtrain.errors import DataError

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text")


def pydoc_text() -> str:
    """About 465 KB of English: the topic help pages of `pydoc_data`, part of every CPython."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def read_text(path: str) -> str:
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES)
        if not files:
            raise DataError(f"data.path={path} is a folder without text files ({', '.join(TEXT_SUFFIXES)}); point it at a file or a folder that has some.")
        return "\n\n".join(f.read_text(errors="replace") for f in files)
    if not p.is_file():
        raise DataError(f"data.path={path} does not exist; give a UTF-8 text file or a folder of text files.")
    return p.read_text(errors="replace")


def load_tokens(cfg: DataConfig) -> tuple[np.ndarray, np.ndarray]:
    """Byte tokens of the source, split into (train, val): the last val_fraction is validation."""
    text = pydoc_text() if cfg.source == "pydoc" else read_text(cfg.path)
    tokens = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    n_val = int(len(tokens) * cfg.val_fraction)
    return tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]


def decode(tokens) -> str:
    return bytes(np.asarray(tokens, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")


def encode(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)
