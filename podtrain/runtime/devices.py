"""Find the accelerator by asking JAX's backends in turn, TPU, then GPU, then CPU; or the one `device_type` forces."""

from __future__ import annotations

import re

import jax

from podtrain.errors import DeviceError

PLATFORMS = ("tpu", "gpu", "cpu")  # the order `auto` tries them in

# Peak dense bf16 FLOP/s per device, for MFU, by the device kind JAX reports (e.g. "NVIDIA H100
# PCIe", "TPU v5 lite"); the first pattern that matches wins. Unknown kinds (CPUs among them)
# report no MFU rather than a wrong one.
PEAK_FLOPS = (
    (r"h100.*pcie", 756e12),
    (r"h100.*nvl", 835e12),
    (r"h100|h200", 989e12),  # SXM ("NVIDIA H100 80GB HBM3"), H200 and GH200
    (r"b200", 2250e12),
    (r"a100", 312e12),
    (r"tpu v3", 123e12),
    (r"tpu v4", 275e12),
    (r"tpu v5 ?(lite|e)", 197e12),  # v5e
    (r"tpu v5", 459e12),  # v5p
    (r"tpu v6", 918e12),  # v6e (Trillium)
)


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def select_devices(device_type: str = "auto") -> list[jax.Device]:
    """All devices of the chosen platform, across every process.

    `auto` takes the first of TPU, GPU and CPU whose JAX backend starts, so a TPU whose runtime
    fails to start falls back to a GPU where there is one. A forced type that JAX cannot start is
    an error that says why.
    """
    platform = {"cuda": "gpu"}.get(device_type, device_type)
    failures = {}
    for candidate in PLATFORMS if platform == "auto" else (platform,):
        try:
            devices = jax.devices(candidate)
        except RuntimeError as e:  # JAX's answer for a backend that is absent or failed to start
            failures[candidate] = _first_line(e)
            continue
        for name, why in failures.items():
            if "failed to initialize" in why:  # present but broken: say so rather than quietly run slower
                print(f"[podtrain] the {name} backend did not start ({why}); using {candidate}")
        return devices
    why = failures[platform] if platform in failures else "; ".join(f"{k}: {v}" for k, v in failures.items())
    extra = "tpu" if platform == "tpu" else "gpu"
    raise DeviceError(
        f"device_type={device_type} was requested but JAX cannot start a {platform.upper()} here ({why}). "
        f"Install the matching extra (`pip install -e '.[{extra}]'`) on a machine that has one, or use device_type=auto to take what is present."
    )


def peak_flops(device: jax.Device) -> float | None:
    kind = device.device_kind.lower()
    return next((flops for pattern, flops in PEAK_FLOPS if re.search(pattern, kind)), None)


def describe(devices: list[jax.Device]) -> str:
    """E.g. `gpu: 1 x NVIDIA H100 80GB HBM3`."""
    return f"{devices[0].platform}: {len(devices)} x {devices[0].device_kind}"
