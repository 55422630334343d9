"""GPU cards described for XLA's GPU compiler, so that a plan compiles for one with no GPU here.

XLA builds a GPU topology from a target description (the card's SMs, shared memory, caches,
memory, compute capability and cuDNN version) and compiles for it as it would on the card
(openxla/xla #16913): the same fusions and the same buffer assignment, so `memory_analysis()` is
the card's. The compiler comes with JAX's CUDA plugin: the `gpu` extra's, or, on a machine with no
CUDA, `jax-cuda12-pjrt` of JAX's version installed in `<environment>/cuda-compiler` (`make` puts it
there), which podtrain loads for a GPU plan only: no other command meets a CUDA plugin.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from podtrain.errors import DeviceError
from podtrain.runtime.chips import CHIPS

COMPILER_DIR = Path(sys.prefix, "cuda-compiler")
CUDNN = (9, 19)  # the cuDNN the description names: XLA picks its fused attention by its version


@dataclass(frozen=True)
class Card:
    """What XLA's GPU compiler asks of a card: the H100's and H200's as the cards report them, the
    A100's from NVIDIA's datasheet."""

    kind: str  # the device_kind JAX reports
    capability: tuple[int, int]
    sms: int
    fp32_lanes_per_sm: int
    shared_memory_per_sm: int
    shared_memory_per_block: int  # the most a block may opt in to
    l2_cache: int
    clock_ghz: float


CARDS = {
    "h100": Card("NVIDIA H100 80GB HBM3", (9, 0), 132, 128, 233472, 232448, 50 * 2**20, 1.98),
    "h200": Card("NVIDIA H200", (9, 0), 132, 128, 233472, 232448, 60 * 2**20, 1.98),
    "a100": Card("NVIDIA A100-SXM4-80GB", (8, 0), 108, 64, 167936, 166912, 40 * 2**20, 1.41),
}


def target_config(name: str) -> str:
    """The card as XLA's GpuTargetConfigProto text."""
    card, chip = CARDS[name], CHIPS[name]
    extension = " feature_extension: ACCELERATED_FEATURES" if card.capability == (9, 0) else ""  # sm_90a
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {card.shared_memory_per_sm}
  threads_per_core_limit: 2048
  core_count: {card.sms}
  fpus_per_core: {card.fp32_lanes_per_sm}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(chip.hbm_bandwidth)}
  l2_cache_size: {card.l2_cache}
  clock_rate_ghz: {card.clock_ghz}
  device_memory_size: {int(chip.memory)}
  shared_memory_per_block_optin: {card.shared_memory_per_block}
  cuda_compute_capability {{ major: {card.capability[0]} minor: {card.capability[1]}{extension} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: {CUDNN[0]} minor: {CUDNN[1]} }}
device_description_str: "{card.kind}"
"""


def _library() -> Path | None:
    return next(COMPILER_DIR.glob("jax_plugins/xla_cuda*/xla_cuda_plugin.so"), None)


def installed() -> bool:
    """Whether a CUDA plugin is here: JAX's own or the one beside this environment."""
    own = importlib.util.find_spec("jax_plugins") is not None and any(
        importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") for v in (12, 13)
    )
    return own or _library() is not None


def _load_compiler() -> None:
    """Register the CUDA plugin installed beside this environment (not among JAX's plugins)."""
    from jax._src import xla_bridge

    library = _library()
    if library is None:
        import jax

        raise DeviceError(
            "A GPU plan compiles with XLA's GPU compiler, from JAX's CUDA plugin, which is not installed here. "
            f"Install it (no GPU or CUDA needed): `pip install --no-deps --target {COMPILER_DIR} "
            f"jax-cuda12-pjrt=={jax.__version__}`, or the gpu extra (`pip install -e '.[gpu]'`)."
        )
    # Loading, its CUDA stub tells stderr that this machine has no CUDA driver: known, and not needed.
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        c_api = xla_bridge.register_plugin("cuda", library_path=str(library))
    finally:
        os.dup2(saved, 2)
        os.close(saved), os.close(null)
    for callback in xla_bridge._plugin_callbacks:  # what JAX's discovery does for a plugin it finds
        callback(c_api=c_api)  # (custom partitioning, as of cuDNN's attention, and FFI targets)


def _cudnn_from_description() -> None:
    """JAX asks the cuDNN library for its version before it emits cuDNN's attention; a machine
    with no CUDA has none: answer the description's."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    asked = cudnn.check_cudnn_version
    if getattr(asked, "described", False):
        return

    def version() -> int:
        try:
            return asked()
        except RuntimeError:
            return CUDNN[0] * 10000 + CUDNN[1] * 100

    version.described = True
    cudnn.check_cudnn_version = version


def devices(name: str, count: int, hosts: int = 1) -> list:
    """Compile-only devices of card `name`: `count` on each of `hosts` hosts."""
    from jax.experimental import topologies

    options = {"target_config": target_config(name), "topology": f"1x{hosts}x{count}"}
    try:
        topology = topologies.get_topology_desc(platform="cuda", **options)
    except NotImplementedError:  # no CUDA plugin among JAX's
        _load_compiler()
        topology = topologies.get_topology_desc(platform="cuda", **options)
    _cudnn_from_description()
    return list(topology.devices)


def chip(name: str):
    """The card's chip, holding what JAX's GPU client may allocate: it takes this fraction of the
    memory up front and allocates from it alone."""
    fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", 0.75))
    return dataclasses.replace(CHIPS[name], memory=CHIPS[name].memory * fraction)
