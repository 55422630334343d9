"""Documents (strings) from a corpus: local text, JSON lines, JSON or Parquet files and folders, a
dataset saved with `datasets.save_to_disk`, a Hugging Face hub dataset streamed by `datasets`, or
`pydoc`, the topic pages every CPython ships.

Files, local or in a bucket (podtrain.storage), are read here rather than through `datasets` so
that a bad row is named by its file and line; hub datasets are streamed, so a corpus larger than
memory never has to fit in it.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from podtrain import storage
from podtrain.errors import DataError

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text")
RECORD_SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass(frozen=True)
class Corpus:
    """Where documents come from: `input` is a file, a folder or a hub dataset name."""

    input: str  # a file, a folder (local or gs://, s3://), a hub dataset's name, or `pydoc`
    text_field: str = "text"
    dataset_name: str | None = None  # the config of a hub dataset, e.g. cosmopedia-v2
    split: str = "train"

    def documents(self) -> Iterator[str]:
        path = storage.path(self.input)
        if self.input == "pydoc" and not path.exists():
            return iter(pydoc_documents())
        if path.is_dir() and any((path / name).is_file() for name in ("dataset_info.json", "dataset_dict.json")):
            return self._saved(path)
        if path.exists() and self.dataset_name is None:
            return self._local(path)
        return self._streamed()

    def _local(self, path: Path) -> Iterator[str]:
        files = local_files(path)
        for file in files:
            if file.suffix.lower() in TEXT_SUFFIXES:
                yield _read_text(file)
            elif file.suffix.lower() == ".parquet":
                yield from self._parquet_rows(file)
            else:
                yield from self._json_rows(file)

    def _field(self, record, where: str) -> str:
        if not isinstance(record, dict) or self.text_field not in record:
            fields = ", ".join(record) if isinstance(record, dict) else f"a {type(record).__name__}, not an object"
            raise DataError(
                f"{where} has no field `{self.text_field}` (it has: {fields}); pass --text-field "
                "with the field that holds the text."
            )
        text = record[self.text_field]
        if not isinstance(text, str):
            raise DataError(
                f"{where}: field `{self.text_field}` holds a {type(text).__name__}, not text; pass --text-field "
                "with the field that holds the text."
            )
        return text

    def _json_rows(self, file: Path) -> Iterator[str]:
        with file.open("rb") as f:
            first = f.read(1).lstrip()
            f.seek(0)
            if file.suffix.lower() == ".json" and first == b"[":  # one JSON list of records
                for row, record in enumerate(_parse_json(f.read(), f"{file}"), 1):
                    yield self._field(record, f"{file}, record {row}")
                return
            for row, line in enumerate(f, 1):
                if line.strip():
                    yield self._field(_parse_json(line, f"{file}, line {row}"), f"{file}, line {row}")

    def _parquet_rows(self, file: Path) -> Iterator[str]:
        import pyarrow.parquet as pq

        with file.open("rb") as f:
            table = pq.ParquetFile(f)
            if self.text_field not in table.schema_arrow.names:
                raise DataError(
                    f"{file} has no column `{self.text_field}` (it has: {', '.join(table.schema_arrow.names)}); "
                    "pass --text-field with the column that holds the text."
                )
            row = 0
            for batch in table.iter_batches(columns=[self.text_field]):
                for text in batch.column(0).to_pylist():
                    row += 1
                    yield self._field({self.text_field: text}, f"{file}, row {row}")

    def _saved(self, path: Path) -> Iterator[str]:
        import datasets

        data = datasets.load_from_disk(str(path))
        if isinstance(data, datasets.DatasetDict):
            if self.split not in data:
                raise DataError(
                    f"The saved dataset {path} has no split `{self.split}` (it has: {', '.join(data)}); pass --split."
                )
            data = data[self.split]
        yield from self._records(data, str(path))

    def _streamed(self) -> Iterator[str]:
        """A hub dataset (or a local folder laid out like one, with --dataset-name), streamed."""
        import datasets

        where = self.input + (f" ({self.dataset_name})" if self.dataset_name else "")
        try:
            data = datasets.load_dataset(self.input, self.dataset_name, split=self.split, streaming=True)
            rows = iter(data)
            first = [next(rows)]
        except StopIteration:
            first = []
        except Exception as e:  # noqa: BLE001 - the hub's many failure types all mean "cannot read it"
            raise DataError(
                f"Could not read the dataset {where}, split {self.split}: {type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}. Check the name (a local path that does not exist is "
                "looked up on the hub), --dataset-name and --split, and that this machine reaches huggingface.co "
                "(or set HF_TOKEN for a gated dataset)."
            ) from None
        yield from self._records(itertools.chain(first, rows), where)

    def _records(self, rows, where: str) -> Iterator[str]:
        for row, record in enumerate(rows, 1):
            yield self._field(record, f"{where}, row {row}")


def pydoc_documents() -> list[str]:
    """About 465 KB of English in 79 documents: the topic help pages of `pydoc_data`."""
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def local_files(path: Path) -> list[Path]:
    """The corpus files of a file or a folder (recursively, in sorted order)."""
    suffixes = TEXT_SUFFIXES + RECORD_SUFFIXES
    if path.is_file():
        files = [path]
    else:
        files = sorted(f for f in path.rglob("*") if f.is_file() and f.suffix.lower() in suffixes)
    if not files:
        raise DataError(
            f"{path} holds no corpus files ({', '.join(suffixes)}); point at a file or a folder that has some."
        )
    unknown = [f for f in files if f.suffix.lower() not in suffixes]
    if unknown:
        raise DataError(
            f"{unknown[0]} is not a corpus file this reader knows ({', '.join(suffixes)}); "
            "convert it or pass a folder of such files."
        )
    return files


def _read_text(file: Path) -> str:
    data = file.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise DataError(
            f"{file} is not UTF-8 text: byte {e.start} (line {line}) is {data[e.start : e.start + 1]!r}. "
            "Re-encode the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)."
        ) from None


def _parse_json(data: bytes, where: str):
    try:
        return json.loads(data)
    except UnicodeDecodeError as e:
        raise DataError(f"{where} is not UTF-8: {e.reason} at byte {e.start}. Re-encode the file as UTF-8.") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{where} is not valid JSON ({e.msg} at column {e.colno}); fix or remove that line.") from None
