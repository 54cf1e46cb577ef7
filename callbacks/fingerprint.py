"""Fingerprints of array leaves, computed on the devices without gathering anything.

Orbax keeps no checksum of array data: a flipped byte restores silently as a
wrong value (PITFALLS.md). A fingerprint per leaf, saved beside the arrays and
recomputed after a restore, catches that. Each one is the wrapping ``uint32``
sum of the leaf's 32-bit words weighted by their position,
``bits[i] * ((2 * i + 1) * 2654435761)``. Integer addition is associative, so
the value is the same for any sharding, any device count and a NumPy copy.
Every weight is odd, so any one-bit flip changes the sum (an even weight, as in
``i * 2654435761 + 1`` for odd ``i``, misses a flip of the top bit).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nnx_spmd_trainer.sharding import path_str

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _leaf_fingerprint(x: jax.Array) -> jax.Array:
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    width = x.dtype.itemsize
    # 8-byte values become pairs of uint32 words; narrower ones widen to uint32.
    bits = jax.lax.bitcast_convert_type(x, _UINT[min(width, 4)]).astype(jnp.uint32)
    # The row-major flat index from one iota per dimension: no reshape, so a sharded
    # array is weighted where it lies and nothing moves between devices but the sum.
    index = jnp.zeros(bits.shape, jnp.uint32)
    for dim in range(bits.ndim):
        index = index * jnp.uint32(bits.shape[dim]) + jax.lax.broadcasted_iota(
            jnp.uint32, bits.shape, dim
        )
    weights = (index * jnp.uint32(2) + jnp.uint32(1)) * jnp.uint32(2654435761)  # all odd
    return jnp.sum(bits * weights, dtype=jnp.uint32)


_fingerprints = jax.jit(lambda leaves: [_leaf_fingerprint(x) for x in leaves])


def fingerprints(tree: Any) -> dict[str, int]:
    """``{leaf path: fingerprint}`` for every array leaf of ``tree`` (one small transfer).

    >>> fingerprints({"w": np.arange(3, dtype=np.float32)}) == fingerprints(
    ...     {"w": jnp.arange(3, dtype=jnp.float32)})
    True
    """
    paths, leaves = zip(*jax.tree_util.tree_flatten_with_path(tree)[0], strict=True)
    values = jax.device_get(_fingerprints(list(leaves)))
    return {path_str(p): int(np.asarray(v)) for p, v in zip(paths, values, strict=True)}


def mismatches(expected: dict[str, int], tree: Any) -> list[str]:
    """The leaf paths of ``tree`` whose fingerprint differs from ``expected`` (or is missing)."""
    actual = fingerprints(tree)
    return sorted(p for p in expected.keys() | actual.keys() if expected.get(p) != actual.get(p))
