"""Placement: host batches onto the mesh, asking the strategy once per kind of batch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from nnx_spmd_trainer import data
from nnx_spmd_trainer.sharding import DataShard


def _batch_key(batch: Any, *extra: Any) -> Any:
    leaves, treedef = jax.tree.flatten(batch)
    return (treedef, tuple(np.shape(x) for x in leaves), *extra)


class Placement:
    """Turns this process's batches into global arrays with the strategy's batch sharding.

    The strategy is asked, and a batch checked, once per batch structure and
    shapes; later batches of the same kind go straight to the devices.

    Attributes:
      data_shard: which rows this process feeds (``strategy.data_shard(mesh)``).
      prefetch: training batches placed ahead of the steps, by a background thread.
      in_flight: the bound on dispatched steps the host has not waited for.
    """

    def __init__(
        self,
        strategy: Any,
        mesh: Mesh,
        data_shard: DataShard,
        *,
        prefetch: int = 2,
        max_steps_in_flight: int = 2,
    ) -> None:
        self.strategy, self.mesh, self.data_shard = strategy, mesh, data_shard
        self.prefetch = prefetch
        self.in_flight = data.InFlight(max_steps_in_flight)
        self._shardings: dict[Any, Any] = {}
        self._multiples: dict[Any, int] = {}

    @property
    def max_steps_in_flight(self) -> int:
        return self.in_flight.limit

    def shardings(self, batch: Any) -> Any:
        """The strategy's batch sharding for batches shaped like ``batch`` (asked once)."""
        key = _batch_key(batch)
        if key not in self._shardings:
            self._shardings[key] = self.strategy.batch_sharding(batch, self.mesh)
        return self._shardings[key]

    def place(self, batch: Any, *, divisor: int = 1) -> Any:
        """This process's batch -> global arrays (checked once per kind of batch)."""
        key = _batch_key(batch, divisor)
        shardings = self._shardings.get(key)
        if shardings is None:
            shardings = self.strategy.batch_sharding(batch, self.mesh)
            data.check_batch(batch, shardings, divisor=divisor, data_shards=self.data_shard.count)
            self._shardings[key] = shardings
        return data.transfer_batch(batch, shardings, data_shards=self.data_shard.count)

    def rows_multiple(self, batch: Any, *, divisor: int = 1) -> int:
        """What this process's rows must be a multiple of, for batches like ``batch``."""
        key = _batch_key(batch, divisor)
        if key not in self._multiples:
            self._multiples[key] = data.rows_multiple(
                self.shardings(batch), divisor=divisor, data_shards=self.data_shard.count
            )
        return self._multiples[key]

    def padded(self, batch: Any, *, divisor: int = 1) -> Any:
        """``batch`` with rows padded to a count the mesh can split, and a ``"mask"``."""
        return data.pad_batch(batch, self.rows_multiple(batch, divisor=divisor))

    def eval_batch(self, batch: Any) -> Any:
        """An eval batch as is, or padded and masked if its rows do not split."""
        leaves = jax.tree.leaves(batch)
        if not isinstance(batch, Mapping) or not leaves or not np.shape(leaves[0]):
            return batch  # placement names what is wrong
        multiple = self.rows_multiple(batch)
        return batch if len(leaves[0]) % multiple == 0 else data.pad_batch(batch, multiple)
