"""Batch placement, one-batch prefetch, and the bound on steps in flight."""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from nnx_spmd_trainer.sharding import ShardingError, spec_axes


def place_batch(batch: Any, shardings: Any, *, divisor: int = 1) -> Any:
    """Turns this process's NumPy batch into global ``jax.Array`` s.

    Args:
      batch: a pytree of arrays holding this process's rows of the global batch.
      shardings: a NamedSharding per leaf (the strategy's answer).
      divisor: extra factor the per-shard batch must divide (gradient accumulation).
    """

    def place(x: Any, sharding: NamedSharding) -> jax.Array:
        x = np.asarray(x)
        parts = math.prod(sharding.mesh.shape[a] for a in spec_axes(sharding.spec))
        global_rows = x.shape[0] * jax.process_count() if x.ndim else 0
        if x.ndim == 0 or global_rows % (parts * divisor):
            accum = f" x {divisor} microbatches" if divisor > 1 else ""
            raise ShardingError(
                f"A global batch of {global_rows} rows (leaf shape {x.shape}) cannot be split "
                f"over the batch axes {sharding.spec} of mesh {dict(sharding.mesh.shape)}"
                f" ({parts} parts{accum}). Use a batch_size divisible by {parts * divisor}."
            )
        return jax.make_array_from_process_local_data(sharding, x)

    return jax.tree.map(place, batch, shardings)


def prefetch(batches: Iterable[Any], place: Callable[[Any], Any]) -> Iterator[Any]:
    """Places the next batch while the current step runs (device transfers are async)."""
    iterator = iter(batches)
    try:
        ahead = place(next(iterator))
    except StopIteration:
        return
    for batch in iterator:
        current, ahead = ahead, place(batch)
        yield current
    yield ahead


class InFlight:
    """Keeps at most ``limit`` dispatched steps unfinished by blocking on the oldest.

    Unbounded async dispatch deadlocks XLA:CPU collectives on simulated devices
    (PITFALLS.md), and a real trainer wants the bound anyway.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"max_steps_in_flight must be >= 1, got {limit}.")
        self.limit = limit
        self._pending: collections.deque[jax.Array] = collections.deque()

    def add(self, marker: jax.Array) -> None:
        self._pending.append(marker)
        while len(self._pending) > self.limit:
            self._pending.popleft().block_until_ready()

    def drain(self) -> None:
        while self._pending:
            self._pending.popleft().block_until_ready()
