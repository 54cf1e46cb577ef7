"""Placement: host batches onto the mesh with the plan's batch shardings (the plan asks its
strategy once per kind of batch), and ``InFlight``, the bound on the steps dispatched
ahead of the host."""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any, Protocol

import jax
import numpy as np

from nnx_spmd_trainer.data import batches, same_rows
from nnx_spmd_trainer.data_shard import DataShard


class BatchLayout(Protocol):
    """What placing a batch asks of a layout (a ``Plan`` answers it): the data stays below
    the planner, handed the answers, never the plan's type."""

    @property
    def data_shard(self) -> DataShard: ...

    def batch_shardings(self, batch: Any) -> Any: ...


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

    def running(self) -> bool:
        """Whether a dispatched step is still computing (asked without waiting)."""
        return bool(self._pending) and not self._pending[-1].is_ready()  # type: ignore[attr-defined]

    def drain(self) -> None:
        while self._pending:
            self._pending.popleft().block_until_ready()

    def clear(self) -> None:
        """Forgets the pending steps without waiting (after a failure)."""
        self._pending.clear()


class Placement:
    """Turns this process's batches into global arrays with the plan's batch shardings.

    The plan asks its strategy once per batch structure, shapes and dtypes
    (``Plan.batch_shardings``), and a batch is checked once per kind; later
    batches of the same kind go straight to the devices. With
    several processes that check also compares the batch with those of the
    processes ``data_shard`` says feed the same rows (``same_rows.check_same_rows``).

    Attributes:
      plan: the layout the batches are placed in.
      data_shard: which rows this process feeds (the plan's ``data_shard``).
      prefetch: training batches placed ahead of the steps, by a background thread.
      in_flight: the bound on dispatched steps the host has not waited for.
    """

    def __init__(
        self, plan: BatchLayout, *, prefetch: int = 2, max_steps_in_flight: int = 2
    ) -> None:
        self.plan, self.data_shard = plan, plan.data_shard
        self.prefetch = prefetch
        self.in_flight = InFlight(max_steps_in_flight)
        # The shardings of each kind of batch (and divisor) already checked: later batches
        # of a kind cost one flatten and a lookup before their transfer.
        self._checked: dict[Any, Any] = {}
        self._multiples: dict[Any, int] = {}

    @property
    def max_steps_in_flight(self) -> int:
        return self.in_flight.limit

    def shardings(self, batch: Any) -> Any:
        """The batch shardings for batches shaped like ``batch`` (``Plan.batch_shardings``)."""
        return self.plan.batch_shardings(batch)

    def place(self, batch: Any, *, divisor: int = 1) -> Any:
        """This process's batch -> global arrays (checked once per kind of batch)."""
        key = batches.batch_kind(batch, divisor)
        shardings = self._checked.get(key)
        if shardings is None:
            shardings = self.plan.batch_shardings(batch)
            batches.check_batch(
                batch, shardings, divisor=divisor, data_shards=self.data_shard.count
            )
            same_rows.check_same_rows(batch, self.data_shard)
            self._checked[key] = shardings
        return batches.transfer_batch(batch, shardings, data_shards=self.data_shard.count)

    def rows_multiple(self, batch: Any, *, divisor: int = 1) -> int:
        """What this process's rows must be a multiple of, for batches like ``batch``."""
        key = batches.batch_kind(batch, divisor)
        if key not in self._multiples:
            self._multiples[key] = batches.rows_multiple(
                self.shardings(batch), divisor=divisor, data_shards=self.data_shard.count
            )
        return self._multiples[key]

    def padded(self, batch: Any, *, divisor: int = 1) -> Any:
        """``batch`` with rows padded to a count the mesh can split, and a ``"mask"``."""
        return batches.pad_batch(batch, self.rows_multiple(batch, divisor=divisor))

    def eval_batch(self, batch: Any) -> Any:
        """An eval batch as is, or padded and masked if its rows do not split."""
        leaves = jax.tree.leaves(batch)
        if not isinstance(batch, Mapping) or not leaves or not np.shape(leaves[0]):
            return batch  # placement names what is wrong
        multiple = self.rows_multiple(batch)
        return batch if len(leaves[0]) % multiple == 0 else batches.pad_batch(batch, multiple)
