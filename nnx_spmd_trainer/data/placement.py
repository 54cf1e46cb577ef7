"""Placement: host batches onto the mesh, asking the strategy once per kind of batch,
and ``InFlight``, the bound on the steps dispatched ahead of the host."""

from __future__ import annotations

import collections
import hashlib
import json
import threading
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from nnx_spmd_trainer.data import batches, same_rows
from nnx_spmd_trainer.data_shard import DataShard
from nnx_spmd_trainer.sharding import ShardingError

if TYPE_CHECKING:
    from nnx_spmd_trainer.planner.plan import Plan


def _batch_key(batch: Any, *extra: Any) -> Any:
    leaves, treedef = jax.tree.flatten(batch)
    return (treedef, tuple(np.shape(x) for x in leaves), *extra)


def _structure(batch: Any) -> str:
    """A batch's leaf paths as the same text on every process (not the treedef's text: a
    custom node's may hold an object's address), and which thread places it: each thread
    places its batches in the same order on every process, two threads need not."""
    paths = ", ".join(
        jax.tree_util.keystr(p) or "<root>" for p, _ in jax.tree_util.tree_leaves_with_path(batch)
    )
    thread = "main" if threading.current_thread() is threading.main_thread() else "other"
    return f"{{{paths}}} placed by the {thread} thread"


#: How long a process waits for the others at a check of the rows they feed.
ROWS_CHECK_TIMEOUT_S = 300
_checks_lock = threading.Lock()
_checks: dict[str, int] = {}  # batch structure -> how many times this process checked one


def _distributed_client() -> Any:
    """JAX's coordination-service client (its key-value store), or None if not found."""
    try:
        from jax._src import distributed  # what jax.distributed.initialize() set up
    except ImportError:  # pragma: no cover - moved in a future JAX
        return None
    client = getattr(distributed.global_state, "client", None)
    needed = ("key_value_set", "blocking_key_value_get")
    return client if all(hasattr(client, m) for m in needed) else None


def rows_key(structure: str, occurrence: int, process: int) -> str:
    """Where ``process`` publishes its ``occurrence``-th check of batches of ``structure``."""
    digest = hashlib.sha1(structure.encode()).hexdigest()[:16]
    return f"nnx_spmd_trainer/same_rows/{digest}/{occurrence}/{process}"


def check_same_rows(batch: Any, data_shard: DataShard) -> None:
    """Raises on every process if processes that ``data_shard`` says feed the same rows
    fed different batches (multi-process runs only; ``Placement.place`` calls it for
    the first batch of each kind).

    Each process publishes its ``DataShard``, its batch's shapes and
    ``same_rows.batch_fingerprint(batch)`` under the batch's structure and how many
    times it has checked one of that structure, then reads every process's: all
    see the same values, so all reach the same verdict and raise together. The
    exchange goes through JAX's coordination service, not the devices: it may run
    in the prefetch thread while steps run, and it does not depend on the order of
    device programs. Shapes are compared, not keyed on, so a process feeding
    another number of rows is named too instead of waiting for the others.
    """
    if jax.process_count() == 1:
        return
    client = _distributed_client()
    if client is None:  # pragma: no cover - JAX moved its client
        warnings.warn(
            "nnx_spmd_trainer: JAX's distributed client was not found, so the processes "
            "cannot check that those feeding the same rows (trainer.placement.data_shard) "
            "agree.",
            stacklevel=3,
        )
        return
    structure = _structure(batch)
    with _checks_lock:
        occurrence = _checks[structure] = _checks.get(structure, -1) + 1
    mine = {
        "shard": list(data_shard),
        "shapes": [list(np.shape(x)) for x in jax.tree.leaves(batch)],
        "fingerprints": same_rows.batch_fingerprint(batch),
    }
    client.key_value_set(rows_key(structure, occurrence, jax.process_index()), json.dumps(mine))
    reports = []
    for process in range(jax.process_count()):
        try:
            value = client.blocking_key_value_get(
                rows_key(structure, occurrence, process), ROWS_CHECK_TIMEOUT_S * 1000
            )
        except Exception as error:  # DEADLINE_EXCEEDED (a JaxRuntimeError)
            raise RuntimeError(
                f"nnx_spmd_trainer: process {process} did not place a batch like "
                f"{structure[:200]} within {ROWS_CHECK_TIMEOUT_S} s of process "
                f"{jax.process_index()}, to check that processes with the same "
                "trainer.placement.data_shard feed equal batches. Every process must place "
                "the same kinds of batches (structure and shapes), in the same order."
            ) from error
        reports.append(json.loads(value))
    names = [
        jax.tree_util.keystr(p) or "<root>" for p, _ in jax.tree_util.tree_leaves_with_path(batch)
    ]
    problem = same_rows.same_rows_error(
        [r["shard"] for r in reports],
        [r["fingerprints"] for r in reports],
        names,
        shapes=[[tuple(s) for s in r["shapes"]] for r in reports],
    )
    if problem:
        raise ShardingError(problem)


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

    def clear(self) -> None:
        """Forgets the pending steps without waiting (after a failure)."""
        self._pending.clear()


class Placement:
    """Turns this process's batches into global arrays with the plan's batch shardings.

    The plan asks its strategy once per batch structure, shapes and dtypes
    (``Plan.batch_shardings``), and a batch is checked once per kind; later
    batches of the same kind go straight to the devices. With
    several processes that check also compares the batch with those of the
    processes ``data_shard`` says feed the same rows (``check_same_rows``).

    Attributes:
      plan: the layout the batches are placed in.
      data_shard: which rows this process feeds (the plan's ``data_shard``).
      prefetch: training batches placed ahead of the steps, by a background thread.
      in_flight: the bound on dispatched steps the host has not waited for.
    """

    def __init__(self, plan: Plan, *, prefetch: int = 2, max_steps_in_flight: int = 2) -> None:
        self.plan, self.data_shard = plan, plan.data_shard
        self.prefetch = prefetch
        self.in_flight = InFlight(max_steps_in_flight)
        self._checked: set[Any] = set()  # kinds of batch (and divisors) already checked
        self._multiples: dict[Any, int] = {}

    @property
    def max_steps_in_flight(self) -> int:
        return self.in_flight.limit

    def shardings(self, batch: Any) -> Any:
        """The batch shardings for batches shaped like ``batch`` (``Plan.batch_shardings``)."""
        return self.plan.batch_shardings(batch)

    def place(self, batch: Any, *, divisor: int = 1) -> Any:
        """This process's batch -> global arrays (checked once per kind of batch)."""
        shardings = self.plan.batch_shardings(batch)
        key = _batch_key(batch, divisor)
        if key not in self._checked:
            batches.check_batch(
                batch, shardings, divisor=divisor, data_shards=self.data_shard.count
            )
            check_same_rows(batch, self.data_shard)
            self._checked.add(key)
        return batches.transfer_batch(batch, shardings, data_shards=self.data_shard.count)

    def rows_multiple(self, batch: Any, *, divisor: int = 1) -> int:
        """What this process's rows must be a multiple of, for batches like ``batch``."""
        key = _batch_key(batch, divisor)
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
