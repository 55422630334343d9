"""Where the job runs: processes, devices and the named mesh. Knows nothing of models."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import jax
from jax.sharding import Mesh

from podtrain import storage
from podtrain.config.schema import Config
from podtrain.runtime import chips, distributed
from podtrain.runtime import devices as devices_lib
from podtrain.runtime import mesh as mesh_lib


@dataclass
class Runtime:
    platform: str
    devices: list
    mesh: Mesh

    @property
    def is_main(self) -> bool:
        return jax.process_index() == 0

    @property
    def peak_flops(self) -> float | None:
        """Peak FLOP/s of the whole mesh, or None where the device's peak is unknown."""
        peak = chips.peak_flops(self.devices[0])
        return peak * len(self.devices) if peak else None


def use_compile_cache(setting: str) -> None:
    """JAX's persistent compilation cache: a program compiled once on this machine (same JAX, same
    devices, same flags) is read from disk by every later run, resume, process and sample.
    `setting` is auto, a folder (a bucket's too: JAX reads it through etils epath), or off."""
    if setting == "off":
        return
    if setting == "auto":
        folder = str(Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "podtrain" / "xla")
    else:
        folder = str(storage.path(setting)) if storage.is_remote(setting) else str(Path(setting).expanduser())
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)  # not the many trivial programs
    jax.config.update("jax_compilation_cache_max_size", 4 * 2**30)  # least recently used entries go beyond it


def start(cfg: Config, announce: bool = True) -> Runtime:
    use_compile_cache(cfg.compile_cache)
    devices_lib.hide_absent_tpu()
    clock = time.perf_counter()
    procs = distributed.initialize(cfg.distributed)
    join_s = time.perf_counter() - clock
    devices = devices_lib.select_devices(cfg.device_type)
    mesh = mesh_lib.build_mesh(cfg.mesh, devices)
    rt = Runtime(devices[0].platform, devices, mesh)
    if announce and jax.process_count() > 1:  # every process, so each log shows that it joined
        local = jax.local_devices(backend=rt.platform)
        print(
            f"[podtrain] process {jax.process_index()}/{jax.process_count()} joined {procs.coordinator} in "
            f"{join_s:.2f} s, with {len(local)} local {rt.platform} devices",
            flush=True,
        )
    if announce and rt.is_main:
        print(
            f"[podtrain] {devices_lib.describe(devices)}, process {jax.process_index()}/{jax.process_count()}, "
            f"{mesh_lib.describe(mesh, cfg.mesh)}",
            flush=True,
        )
    return rt
