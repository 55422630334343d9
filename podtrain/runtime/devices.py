"""Find the accelerator by asking JAX's backends in turn, TPU, then GPU, then CPU; or the one `device_type` forces."""

from __future__ import annotations

import glob
import os

import jax

from podtrain.errors import DeviceError, first_line

PLATFORMS = ("tpu", "gpu", "cpu")  # the order `auto` tries them in


def hide_absent_tpu() -> None:
    """Keep JAX from starting libtpu (the `tpu` extra) on a machine with no TPU, which prints
    a screen of warnings before falling back: ask only for GPU and CPU unless TPU chips
    (/dev/accel*, /dev/vfio) are present or JAX_PLATFORMS says otherwise."""
    if (
        not os.environ.get("JAX_PLATFORMS")
        and not jax.config.jax_platforms
        and not glob.glob("/dev/accel*") + glob.glob("/dev/vfio/[0-9]*")
    ):
        jax.config.update("jax_platforms", "cuda,cpu")


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
            failures[candidate] = first_line(e, 1000)
            continue
        for name, why in failures.items():
            # Present but broken: say so rather than quietly run slower. A runtime library that is not
            # installed (JAX's TPU backend on a GPU machine) is an absent backend, not a broken one.
            if "failed to initialize" in why and "cannot open shared object file" not in why:
                print(f"[podtrain] the {name} backend did not start ({why}); using {candidate}")
        return devices
    why = failures[platform] if platform in failures else "; ".join(f"{k}: {v}" for k, v in failures.items())
    extra = "tpu" if platform == "tpu" else "gpu"
    raise DeviceError(
        f"device_type={device_type} was requested but JAX cannot start a {platform.upper()} here ({why}). "
        f"Install the matching extra (`pip install -e '.[{extra}]'`) on a machine that has one, or use "
        "device_type=auto to take what is present."
    )


def describe(devices: list[jax.Device]) -> str:
    """E.g. `gpu: 1 x NVIDIA H100 80GB HBM3`."""
    return f"{devices[0].platform}: {len(devices)} x {devices[0].device_kind}"
