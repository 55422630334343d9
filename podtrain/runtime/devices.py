"""Find the accelerator: TPU, then GPU, then CPU; or the one `device_type` forces."""

from __future__ import annotations

import glob
import os

import jax

from podtrain.errors import DeviceError

# Peak dense bf16 FLOP/s per device, for MFU. Unknown kinds (CPUs among them) report no MFU.
PEAK_FLOPS = {
    "h200": 989e12,
    "h100": 989e12,
    "a100": 312e12,
    "l4": 121e12,
    "tpu v3": 123e12,
    "tpu v4": 275e12,
    "tpu v5 lite": 197e12,
    "tpu v5e": 197e12,
    "tpu v5p": 459e12,
    "tpu v5": 459e12,
    "tpu v6 lite": 918e12,
    "tpu v6e": 918e12,
}


def _tpu_present() -> bool:
    return bool(glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*") or os.environ.get("TPU_ACCELERATOR_TYPE"))


def _gpu_present() -> bool:
    return bool(glob.glob("/dev/nvidia[0-9]*") or glob.glob("/dev/kfd"))


def select_devices(device_type: str = "auto") -> list[jax.Device]:
    """All devices of the chosen platform, across every process.

    `auto` looks for TPU and GPU hardware before asking JAX, so a machine without a TPU never
    pays libtpu's start-up probing (and its warnings), and falls back to CPU if the accelerator's
    JAX plugin is missing. A forced type that JAX cannot find is an error.
    """
    platform = {"cuda": "gpu"}.get(device_type, device_type)
    forced = platform != "auto"
    if not forced:
        platform = "tpu" if _tpu_present() else "gpu" if _gpu_present() else "cpu"
    if platform == "cpu" and not os.environ.get("JAX_PLATFORMS"):
        jax.config.update("jax_platforms", "cpu")
    try:
        return jax.devices(platform)
    except RuntimeError as e:
        if forced:
            raise DeviceError(
                f"device_type={device_type} was requested but JAX finds no {platform.upper()} here ({str(e).splitlines()[0]}). "
                f"Install the matching extra (`pip install -e '.[{'tpu' if platform == 'tpu' else 'gpu'}]'`) on a machine that has one, "
                "or use device_type=auto to take what is present."
            ) from None
        print(f"[podtrain] {platform} hardware found but JAX cannot use it ({str(e).splitlines()[0]}); using cpu")
        return jax.devices("cpu")


def peak_flops(device: jax.Device) -> float | None:
    kind = device.device_kind.lower()
    for name, flops in PEAK_FLOPS.items():
        if name in kind:
            return flops
    return None


def describe(devices: list[jax.Device]) -> str:
    """E.g. `gpu: 1 x NVIDIA H100 80GB HBM3`."""
    return f"{devices[0].platform}: {len(devices)} x {devices[0].device_kind}"
