"""The chips podtrain knows: each JAX device's memory, peak FLOP/s and bandwidths, for MFU in
`train` and for the roofline of `plan`."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import jax

GiB = 2**30


@dataclass(frozen=True)
class TpuSlices:
    """How a TPU generation's slices are named and shaped."""

    cores_per_chip: int  # a slice's name counts cores: a v4-32 is 16 chips
    megacore: bool  # one JAX device per chip (else one per core)
    torus: int  # the dimensions of its slices' torus: 2 or 3


@dataclass(frozen=True)
class Chip:
    """One JAX device's resources: what a roofline needs."""

    name: str
    kind: str  # pattern of the device_kind JAX reports for it
    memory: float  # bytes a program may use on one device
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bandwidth: float  # bytes/s
    link_bandwidth: float  # bytes/s one device moves in a ring collective (both directions of its ring)
    dcn_bandwidth: float | None = None  # bytes/s one device sends to other slices (or hosts) over the network
    tpu: TpuSlices | None = None  # a TPU's slices
    # dense FLOP/s (OP/s) of matmuls whose operands are narrower than bf16, by model.matmul_precision
    narrow_flops: dict[str, float] = field(default_factory=dict)

    def matmul_peak(self, precision: str) -> float:
        """Peak FLOP/s of matmuls under a precision policy: bf16's where the chip has nothing faster."""
        return self.narrow_flops.get(precision, self.peak_flops)


# Sources: TPU: the Cloud TPU system-architecture pages (peak bf16 FLOP/s, HBM, bandwidth) and
# "How to Scale Your Model" (ICI: 4.5e10 B/s one way per link on v4/v5e, 9e10 on v5p/v6e; a ring
# over one mesh axis uses a link each way). Usable HBM is what XLA's TPU compiler reports as
# available (libtpu 0.0.42, measured): a little under the nominal 16/32/95 GiB. v3 shows one JAX
# device per core (half a chip); v4 and v5p one per chip (megacore). GPU: NVIDIA's datasheets
# (SXM; dense bf16; NVLink 450 GB/s per direction on H100/H200, 300 on A100), memory as CUDA
# reports it (read from the cards: an H100's 85,017,493,504 B, of which JAX's limit took 59.38 GiB
# at its default fraction 0.75; an H200's 150,109,880,320 B, 104.85 GiB); a GPU target holds
# XLA_PYTHON_CLIENT_MEM_FRACTION of it. Across slices or hosts (DCN): the Cloud TPU pages'
# network per chip (v5p 50 Gbps; v5e 2 x 100 and v6e 4 x 200 Gbps NICs per 8-chip host; v4 taken
# as v5p's, a v3 core as a v5e chip) and one InfiniBand NIC per GPU (DGX H100: 400 Gb/s; A100: 200).
# Narrow matmuls, dense: int8 on v5e/v5p/v6e (the Cloud TPU pages; v4's int8 runs at its bf16
# rate, v3 has none); fp8 and int8 on H100/H200, int8 on A100 (datasheets; the A100 has no fp8).
HOPPER = {"fp8": 1979e12, "int8": 1979e12}
CHIPS = {
    "v3": Chip(
        "TPU v3 (per core)", r"tpu v3", 15.48 * GiB, 61.5e12, 450e9, 2 * 4.5e10, 3.125e9, TpuSlices(2, False, 2)
    ),
    "v4": Chip("TPU v4", r"tpu v4", 30.75 * GiB, 275e12, 1.2e12, 2 * 4.5e10, 6.25e9, TpuSlices(2, True, 3)),
    "v5e": Chip(
        "TPU v5e",
        r"tpu v5 ?(lite|e)",
        15.75 * GiB,
        197e12,
        819e9,
        2 * 4.5e10,
        3.125e9,
        TpuSlices(1, False, 2),
        {"int8": 394e12},
    ),
    "v5p": Chip(
        "TPU v5p", r"tpu v5", 95.74 * GiB, 459e12, 2.765e12, 2 * 9e10, 6.25e9, TpuSlices(2, True, 3), {"int8": 918e12}
    ),
    "v6e": Chip(
        "TPU v6e", r"tpu v6", 31.25 * GiB, 918e12, 1.64e12, 2 * 9e10, 12.5e9, TpuSlices(1, False, 2), {"int8": 1836e12}
    ),
    "h100": Chip("NVIDIA H100 SXM", r"h100|gh200", 85_017_493_504, 989e12, 3.35e12, 450e9, 50e9, None, HOPPER),
    "h200": Chip("NVIDIA H200", r"h200", 150_109_880_320, 989e12, 4.8e12, 450e9, 50e9, None, HOPPER),
    "a100": Chip("NVIDIA A100 SXM", r"a100", 85_198_045_184, 312e12, 2.039e12, 300e9, 25e9, None, {"int8": 624e12}),
}
# Peak FLOP/s of kinds seen on real devices that no planning target names (for MFU in `train`).
OTHER_PEAKS = ((r"h100.*pcie", 756e12), (r"h100.*nvl", 835e12), (r"b200", 2250e12))


def chip_of(device) -> Chip | None:
    """The chip of a real device by its kind; None where unknown (CPUs)."""
    return next((c for c in CHIPS.values() if re.search(c.kind, device.device_kind.lower())), None)


def peak_flops(device) -> float | None:
    """Peak FLOP/s of a real device by its kind; None where unknown (CPUs)."""
    kind = device.device_kind.lower()
    for pattern, flops in OTHER_PEAKS:
        if re.search(pattern, kind):
            return flops
    chip = chip_of(device)
    return chip.peak_flops if chip else None


def host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_memory(device) -> float:
    """Bytes one of these devices may use: the runtime's limit on GPU and TPU; on CPU this
    machine's memory shared by its local devices."""
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and stats.get("bytes_limit"):
        return float(stats["bytes_limit"])
    return host_memory() / len(jax.local_devices(backend="cpu"))
