"""Generic helpers on trees of arrays, below every part that names a leaf or a state's items."""

from __future__ import annotations

ITEMS = ("params", "opt", "ema", "carry")  # every item a train state may have that a checkpoint keeps


def leaf_name(path) -> str:
    """A leaf's path as "opt/0/mu/embed": the same for a state's tuples and the dicts it is saved as."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
