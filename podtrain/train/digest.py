"""Checksums of a tree of arrays, computed where the arrays live, the same on any mesh.

Each array gets two 32-bit sums of its bits: a plain one and one weighted by each element's
odd position factor 2i+1. Integer sums wrap exactly and in any order, so the compiler may split
them over shards and hosts and the result does not depend on the mesh; and since 2i+1 is odd,
any change to a single element changes the weighted sum. This catches damaged files, not
tampering: it is a checksum, not a cryptographic hash.
"""

from __future__ import annotations

import functools
import hashlib
import json

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from podtrain.trees import leaf_name

_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _bits(x: jax.Array) -> jax.Array:
    """The bits of each element as uint32."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    return lax.bitcast_convert_type(x, _UNSIGNED[x.dtype.itemsize]).astype(jnp.uint32)


def _checksum(x: jax.Array) -> jax.Array:
    """[sum of bits, sum of bits * (2i+1)] over row-major element indices i, modulo 2**32. The
    index sum is taken axis by axis, sum_k stride_k * sum_j j * (bits summed over the other
    axes)[j], so that only reductions of the array run: no temporary of its size, and no
    reshape that would regroup its shards."""
    bits = _bits(x)
    total = bits.sum(dtype=jnp.uint32)
    index_sum, stride = jnp.uint32(0), 1
    for axis in reversed(range(bits.ndim)):
        marginal = bits.sum(axis=tuple(a for a in range(bits.ndim) if a != axis), dtype=jnp.uint32)
        weighted = (lax.iota(jnp.uint32, bits.shape[axis]) * marginal).sum(dtype=jnp.uint32)
        index_sum = index_sum + weighted * jnp.uint32(stride % 2**32)
        stride *= bits.shape[axis]
    return jnp.stack([total, 2 * index_sum + total])


@functools.cache
def _checksummer(mesh: Mesh):
    """One jitted function per mesh, compiled once per array layout; its sums replicated so every process reads them."""
    return jax.jit(_checksum, out_shardings=NamedSharding(mesh, PartitionSpec()))


def checksums(tree) -> dict[str, list[int]]:
    """{name of each array: [sum, weighted sum]} for a tree of arrays placed on one mesh."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    if not leaves:
        return {}
    checksum = _checksummer(leaves[0][1].sharding.mesh)
    # One array per program, each finished before the next starts: the compiler keeps an array's
    # bits as a temporary, so a program over the whole state would need a second state's worth of
    # memory at every save, and programs in flight together would hold theirs at once.
    sums = [checksum(x).block_until_ready() for _, x in leaves]
    return {leaf_name(path): [int(v) for v in s] for (path, _), s in zip(leaves, jax.device_get(sums))}


def fingerprint(recorded: dict) -> str:
    """A short name for a checkpoint's recorded checksums, to compare checkpoints at a glance."""
    return hashlib.sha256(json.dumps(recorded, sort_keys=True).encode()).hexdigest()[:16]
