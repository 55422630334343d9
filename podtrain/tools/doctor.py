"""`podtrain doctor`: do this job's processes and devices work together? An all-reduce over the mesh."""

from __future__ import annotations

import socket
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from podtrain import runtime
from podtrain.config.schema import Config
from podtrain.errors import DistributedError


def all_reduce(mesh: Mesh, repeats: int = 10) -> tuple[float, float, float]:
    """Sum over all devices of (owning process index + 1): (result, expected, median seconds)."""
    devices = mesh.devices.ravel()
    shape = (devices.size,)  # one element per device
    x = jax.make_array_from_callback(
        shape,
        NamedSharding(mesh, PartitionSpec(mesh.axis_names)),
        lambda _: np.full((1,), jax.process_index() + 1.0, np.float32),
    )
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, PartitionSpec()))
    result = float(total(x))  # also compiles
    times = []
    for _ in range(repeats):
        clock = time.perf_counter()
        jax.block_until_ready(total(x))
        times.append(time.perf_counter() - clock)
    return result, float(sum(d.process_index + 1 for d in devices)), statistics.median(times)


def doctor(cfg: Config) -> None:
    rt = runtime.start(cfg)
    index, count = jax.process_index(), jax.process_count()
    result, expected, seconds = all_reduce(rt.mesh)
    print(
        f"[doctor] process {index}/{count} on {socket.gethostname()}: {len(jax.local_devices(backend=rt.platform))} local devices, "
        f"all-reduce over {rt.mesh.devices.size} devices = {result:g} (expected {expected:g}) in {seconds * 1e3:.2f} ms",
        flush=True,
    )
    # Every process's result, gathered so process 0 can say which ones went wrong.
    results = np.asarray(multihost_utils.process_allgather(np.array([result, seconds]))).reshape(count, 2)
    wrong = [i for i in range(count) if results[i, 0] != expected]
    if rt.is_main:
        slowest = int(results[:, 1].argmax())
        print(
            f"[doctor] {count - len(wrong)}/{count} processes got the right all-reduce; slowest: process {slowest} at {results[slowest, 1] * 1e3:.2f} ms",
            flush=True,
        )
    if wrong:
        raise DistributedError(
            f"The all-reduce over the mesh gave a wrong result on processes {wrong} (expected {expected:g}); check those hosts' devices and interconnect."
        )
