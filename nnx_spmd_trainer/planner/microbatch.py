"""Gradient accumulation's microbatches: a batch cut into k without moving data, and the
per-example values of the k put back in the batch's row order."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

Batch = Any


def microbatches(batch: Batch, k: int, sharding: Any) -> Batch:
    """Splits the leading dimension into k microbatches, each spread over all devices.

    Row ``r * k + j`` goes to microbatch ``j``: every device keeps the rows it
    already holds, so the split moves no data.
    """

    def split(x: jax.Array, s: NamedSharding) -> jax.Array:
        x = x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1)
        return jax.lax.with_sharding_constraint(x, NamedSharding(s.mesh, P(None, *s.spec)))

    return jax.tree.map(split, batch, sharding)


def rows_sharding(batch_sharding: Any) -> NamedSharding | None:
    """The layout of a batch's rows: its first leaf's leading entry, if it splits them."""
    leaves = jax.tree.leaves(batch_sharding)
    first = leaves[0] if leaves else None
    if not isinstance(first, NamedSharding) or not first.spec or first.spec[0] is None:
        return None
    return NamedSharding(first.mesh, P(first.spec[0]))


def join_microbatches(
    stacked: dict[str, jax.Array],
    weights: jax.Array,
    rows: int,
    rows_sharding: NamedSharding | None = None,
) -> dict[str, jax.Array]:
    """The ``aux`` of one batch from its k microbatches' (the inverse of ``microbatches``).

    ``stacked`` holds each microbatch's values along a new leading axis of k.
    A per-example value (``(k, rows / k, ...)``) comes back as ``(rows, ...)`` in
    the batch's own row order: microbatch ``j``'s row ``r`` is batch row
    ``r * k + j``, so it lines up with the batch's ``"mask"``. Any other value
    (a scalar per microbatch, above all) is one value of each microbatch, as
    its loss is, and is averaged as the loss is: weighted by ``weights`` (each
    microbatch's real examples over the batch's, or 1/k).
    """
    k = weights.shape[0]

    def join(a: jax.Array) -> jax.Array:
        if a.ndim >= 2 and a.shape[0] == k and a.shape[1] * k == rows:
            a = a.swapaxes(0, 1).reshape(rows, *a.shape[2:])
            if rows_sharding is not None:
                a = jax.lax.with_sharding_constraint(a, rows_sharding)
            return a
        w = weights.reshape(k, *(1,) * (a.ndim - 1))
        return jnp.sum(a.astype(jnp.float32) * w, axis=0)

    return jax.tree.map(join, stacked)
