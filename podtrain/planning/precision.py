"""What a low-precision policy (`model.matmul_precision`, models/ops.py) buys on a target: the
compiled matmuls whose operands are in its format run at the chip's rate for it, the rest at
bfloat16's; a policy the chip cannot run faster, or that the compiler did not keep narrow, is
said so."""

from __future__ import annotations

from podtrain.models.ops import PRECISIONS
from podtrain.runtime.chips import Chip


def compute_seconds(chip: Chip, matmul_flops: float, narrow_flops: float, policy: str) -> float:
    """Seconds of a device's matmuls: `narrow_flops` of them at the policy's peak, the rest at bf16's."""
    return (matmul_flops - narrow_flops) / chip.peak_flops + narrow_flops / chip.matmul_peak(policy)


def no_gain(chip: Chip | None, policy: str) -> str | None:
    """Why `policy` buys nothing on `chip` (None: a CPU, which emulates the formats), or None where it pays."""
    if PRECISIONS[policy] is None or (chip and chip.matmul_peak(policy) > chip.peak_flops):
        return None
    where = (
        f"the {chip.name} (no {policy} rate above its bf16 {chip.peak_flops / 1e12:,.0f} TFLOP/s)" if chip else "CPUs"
    )
    return (
        f"{policy} matmuls run no faster than bf16 on {where}: expect the rounding without the speed-up "
        "(model.matmul_precision=compute avoids both)"
    )


def sentence(chip: Chip, policy: str, matmul_flops: float | None, narrow_flops: float | None) -> str | None:
    """The plan's word on the policy: None under one that quantizes nothing (the compute dtype)."""
    if PRECISIONS[policy] is None:
        return None
    if said := no_gain(chip, policy):
        return said
    if not matmul_flops or not narrow_flops:
        return f"no {policy} matmuls in the compiled step: the compiler widened them; they run at bf16's rate"
    return (
        f"{narrow_flops / matmul_flops:.0%} of the compiled matmul FLOPs in {policy}, at "
        f"{chip.matmul_peak(policy) / 1e12:,.0f} TFLOP/s against bf16's {chip.peak_flops / 1e12:,.0f}"
    )
