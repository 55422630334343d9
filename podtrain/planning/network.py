"""What a compiled step moves between devices: over their own links (ICI, NVLink) and, between
slices or hosts, over the data-centre network."""

from __future__ import annotations

from podtrain.planning import hlo

RING = {"all-reduce": 2.0, "all-gather": 1.0, "reduce-scatter": 1.0, "all-to-all": 1.0, "ragged-all-to-all": 1.0}


def link_bytes(found: list[hlo.Collective]) -> float:
    """Bytes one device sends per step over its links, each collective as a ring over its group."""
    total = 0.0
    for c in found:
        n = c.group_size or 2
        total += c.total_bytes * (RING[c.kind] * (n - 1) / n if c.kind in RING else 1.0)
    return total


def across_hosts(found: list[hlo.Collective], slice_of: list[int]) -> float:
    """Bytes one device sends per step to other hosts in collectives that span them (a GPU
    program's; a TPU program's cross only through `hlo.megascale_sends`). A collective over g
    devices on d hosts runs host by host: within each over its links, then across them on a g/d-th
    of its bytes per device, a ring over d hosts: RING x (d - 1) / g of them."""
    total = 0.0
    for c in found:
        ids = hlo.group(c)
        d = len({slice_of[i] for i in ids})
        if d > 1:
            total += c.total_bytes * (RING[c.kind] * (d - 1) / len(ids) if c.kind in RING else 1.0)
    return total
