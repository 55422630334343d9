"""The machinery of config keys: a key's default, description and valid values (`key`), numeric
ranges written as in the docs (`Range`), and walks over a config's keys."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Range:
    """The valid values of a numeric key: finite numbers in an interval, written as in the docs:
    `> 0`, `>= 1`, `[0, 1)`, `finite`, `-1 or >= 1` (-1 meaning "the rest"), or `auto or >= 1`."""

    text: str

    def _parts(self) -> tuple[bool, float, float, bool, bool]:
        """(minus_one_allowed, low, high, low_open, high_open)."""
        text = self.text.removeprefix("auto or ")
        minus_one = text.startswith("-1 or ")
        text = text.removeprefix("-1 or ")
        if text == "finite":
            return minus_one, -math.inf, math.inf, True, True
        if m := re.fullmatch(r"(>=?) (\S+)", text):
            return minus_one, float(m[2]), math.inf, m[1] == ">", True
        m = re.fullmatch(r"([\[(])(\S+), (\S+)([\])])", text)
        return minus_one, float(m[2]), float(m[3]), m[1] == "(", m[4] == ")"

    def __contains__(self, value) -> bool:
        if value == "auto":
            return self.text.startswith("auto or ")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        minus_one, low, high, low_open, high_open = self._parts()
        if minus_one and value == -1:
            return True
        return (low < value if low_open else low <= value) and (value < high if high_open else value <= high)

    def __str__(self) -> str:
        return self.text


def key(default, doc: str, valid: str | None = None):
    """A config key: its default, what it does, and for a number its valid values (a Range text,
    e.g. "[0, 1)"); a malformed range fails at import. A list default is copied for each config."""
    metadata: dict[str, Any] = {"doc": doc}
    if valid is not None:
        Range(valid)._parts()
        metadata["range"] = Range(valid)
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def default_of(f: dataclasses.Field):
    """A field's default value, also for one made by a factory (a list)."""
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def same_key(cls, name: str, default):
    """A subclass's own default for a key `cls` defines, with the same description and range."""
    return field(default=default, metadata=cls.__dataclass_fields__[name].metadata)


def leaves(node: Any, prefix: str = "") -> list[tuple[str, dataclasses.Field, Any]]:
    """(dotted key, field, value) of every value of a config, e.g. ("train.lr", its field, 0.002)."""
    found = []
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            found += leaves(value, f"{prefix}{f.name}.")
        else:
            found.append((prefix + f.name, f, value))
    return found


def all_keys(node: Any) -> list[str]:
    return [name for name, _, _ in leaves(node)]


def ranges(node: Any) -> list[tuple[str, Range, Any]]:
    """(dotted key, valid values, value) of every numeric key of a config."""
    return [(name, f.metadata["range"], value) for name, f, value in leaves(node) if "range" in f.metadata]
