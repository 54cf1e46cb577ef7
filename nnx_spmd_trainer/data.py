"""Batch placement and the bound on steps in flight."""

from __future__ import annotations

import collections
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from nnx_spmd_trainer.sharding import ShardingError, spec_axes


def place_batch(batch: Any, shardings: Any, *, divisor: int = 1) -> Any:
    """Turns this process's NumPy batch into global ``jax.Array`` s.

    With several processes each contributes its rows
    (``jax.make_array_from_process_local_data``); with one, the same layout
    comes from a single batched ``jax.device_put``.

    Args:
      batch: a pytree of arrays holding this process's rows of the global batch.
      shardings: a NamedSharding per leaf (the strategy's answer).
      divisor: extra factor the per-shard batch must divide (gradient accumulation).
    """

    def check(path: Any, x: Any, sharding: NamedSharding) -> np.ndarray:
        x = np.asarray(x)
        where = f"batch leaf {jax.tree_util.keystr(path) or '<root>'} with shape {x.shape}"
        if x.ndim == 0:
            raise ShardingError(
                f"{where} is a scalar; every batch leaf needs a leading batch dimension. "
                "Give it one (e.g. np.full((batch_size,), value))."
            )
        parts = math.prod(sharding.mesh.shape[a] for a in spec_axes(sharding.spec))
        # A split batch is the concatenation of every process's rows; a replicated one is not.
        global_rows = x.shape[0] * (jax.process_count() if parts > 1 else 1)
        if global_rows % (parts * divisor):
            accum = f" x {divisor} microbatches" if divisor > 1 else ""
            raise ShardingError(
                f"{where}: a global batch of {global_rows} rows cannot be split over the batch "
                f"axes {sharding.spec} of mesh {dict(sharding.mesh.shape)} ({parts} parts"
                f"{accum}). Use a batch_size divisible by {parts * divisor}."
            )
        return x

    batch = jax.tree_util.tree_map_with_path(check, batch, shardings)
    if jax.process_count() == 1:  # one batched transfer for all leaves
        return jax.device_put(batch, shardings)
    return jax.tree.map(jax.make_array_from_process_local_data, shardings, batch)


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
