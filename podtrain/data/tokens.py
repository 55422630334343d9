"""Prepared token shards, as `podtrain data prepare` writes them and training reads them.

DIR/manifest.json       what the shards hold: the tokenizer's identity, counts, the source
DIR/tokenizer/          a copy of the tokenizer, so the folder is self-contained
DIR/train-NNNNN.npy     the tokens of each training document followed by EOS, uint16 or uint32
DIR/val-NNNNN.npy       the same for the validation documents of that shard

Plain `.npy` files are memory-mapped: a window is a slice, read by random access without
loading a shard, and any process count can read any rows. Shards in a bucket are read the same
way, by byte range (`RemoteShard`): the first step never waits for a download, and each process
fetches only the blocks that hold its own rows.
"""

from __future__ import annotations

import functools
import io
import json
import threading
from pathlib import Path

import numpy as np

from podtrain import storage
from podtrain.errors import DataError

FORMAT = 1
MANIFEST = "manifest.json"
BLOCK = 1 << 20  # bytes a range read fetches: neighbouring windows share it
CACHE_BLOCKS = 256  # blocks kept per process (256 MiB): a small corpus is fetched once
# Opening a shard parses its `.npy` header with ast.literal_eval, which CPython 3.11 cannot run in two
# threads at once ("SystemError: AST constructor recursion depth mismatch"); the loader reads in threads.
_OPENING = threading.Lock()


def shard_file(folder: Path, split: str, index: int) -> Path:
    return folder / f"{split}-{index:05d}.npy"


def load_manifest(path: str | Path) -> dict:
    folder = storage.path(path)
    file = folder / MANIFEST
    if not file.is_file():
        unfinished = (
            " It holds shards of a prepare that did not finish: "
            "rerun that `podtrain data prepare` command to complete it."
            if (folder / "prepare.json").is_file()
            else ""
        )
        raise DataError(
            f"data.path={path} is not a folder of prepared tokens (no {MANIFEST}).{unfinished} "
            "Make one with `podtrain data prepare --input CORPUS --tokenizer TOKENIZER --out DIR` (CORPUS may "
            "be a hub dataset such as HuggingFaceTB/smollm-corpus with --dataset-name cosmopedia-v2), then train "
            "with data.source=tokens data.path=DIR."
        )
    manifest = json.loads(file.read_text())
    if manifest.get("format") != FORMAT:
        raise DataError(
            f"{file} has format {manifest.get('format')}, not {FORMAT}; prepare the corpus "
            "again with this version of podtrain."
        )
    return manifest


class TokenStream:
    """The tokens of one split of prepared shards as one sequence: its length and slices of it.
    Shards are opened lazily, so the stream pickles as its file names (for loader workers)."""

    def __init__(self, files: list[Path], sizes: list[int], itemsize: int = 2):
        self.files, self.ends, self.itemsize = [str(f) for f in files], np.cumsum([0, *sizes]), itemsize
        self._arrays = None

    @classmethod
    def of(cls, folder: str | Path, manifest: dict, split: str) -> TokenStream:
        shards = [s for s in manifest["shards"] if s[f"{split}_tokens"]]
        return cls(
            [shard_file(storage.path(folder), split, s["index"]) for s in shards],
            [s[f"{split}_tokens"] for s in shards],
            np.dtype(manifest["dtype"]).itemsize,
        )

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_arrays": None}

    def __len__(self) -> int:
        return int(self.ends[-1])

    @property
    def beyond_cache(self) -> bool:
        """Whether reading a window may wait on a request after the first pass: shards in a bucket
        larger than the block cache."""
        remote = any(storage.is_remote(f) for f in self.files)
        return remote and len(self) * self.itemsize > CACHE_BLOCKS * BLOCK

    def _shards(self) -> list[np.ndarray]:
        if self._arrays is None:
            with _OPENING:
                if self._arrays is None:  # not opened by another thread while this one waited
                    self._arrays = self._open()
        return self._arrays

    def _open(self) -> list[np.ndarray]:
        try:
            return [RemoteShard(f) if storage.is_remote(f) else np.load(f, mmap_mode="r") for f in self.files]
        except (OSError, ValueError) as e:
            raise DataError(
                f"Could not read the prepared shards ({e}); prepare the corpus again into a new folder."
            ) from None

    def __getitem__(self, window: slice) -> np.ndarray:
        start, stop, _ = window.indices(len(self))
        shards, pieces = self._shards(), []
        first = int(np.searchsorted(self.ends, start, side="right")) - 1
        for i in range(first, len(shards)):
            if self.ends[i] >= stop:
                break
            lo, hi = max(start, self.ends[i]) - self.ends[i], min(stop, self.ends[i + 1]) - self.ends[i]
            pieces.append(shards[i][lo:hi])
        return np.concatenate(pieces) if len(pieces) != 1 else pieces[0]


@functools.lru_cache(maxsize=CACHE_BLOCKS)
def _block(url: str, index: int, size: int) -> bytes:
    """Bytes [index x BLOCK, (index + 1) x BLOCK) of an object of `size` bytes, in one range request."""
    return storage.filesystem(url).cat_file(storage.key(url), start=index * BLOCK, end=min((index + 1) * BLOCK, size))


@functools.cache
def _layout(url: str) -> tuple[int, int, np.dtype, int]:
    """(object bytes, tokens, dtype, where the tokens start) of a `.npy` in a bucket, read once per process
    (the loader's threads and workers make copies of the stream)."""
    size = storage.filesystem(url).size(storage.key(url))
    head = io.BytesIO(_block(url, 0, size))
    version = np.lib.format.read_magic(head)
    read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    (length,), _, dtype = read_header(head)
    return size, length, dtype, head.tell()


class RemoteShard:
    """A 1-D `.npy` in a bucket, sliced like the memory map of a local one: each slice is read by
    byte range, in blocks of BLOCK bytes kept in a per-process cache of CACHE_BLOCKS."""

    def __init__(self, url: str):
        self.url = url
        self.size, self.length, self.dtype, self.offset = _layout(url)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, window: slice) -> np.ndarray:
        lo, hi, _ = window.indices(self.length)
        start, stop = self.offset + lo * self.dtype.itemsize, self.offset + hi * self.dtype.itemsize
        if stop <= start:
            return np.zeros(0, self.dtype)
        blocks = [_block(self.url, i, self.size) for i in range(start // BLOCK, (stop - 1) // BLOCK + 1)]
        data = blocks[0] if len(blocks) == 1 else b"".join(blocks)  # one block, most windows: no copy
        return np.frombuffer(data, self.dtype, count=hi - lo, offset=start % BLOCK)
