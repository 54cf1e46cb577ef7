"""Batches: placement, the bound on steps in flight, and a resumed run's data position."""

from __future__ import annotations

import collections
import json
import math
import warnings
import zlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import grain
import jax
import numpy as np
from jax.sharding import NamedSharding

from nnx_spmd_trainer.prefetch import has_position
from nnx_spmd_trainer.sharding import (
    ShardingError,
    dimension_axes,
    fed_dimension,
    global_batch_shape,
)


def place_batch(batch: Any, shardings: Any, *, divisor: int = 1, data_shards: int = 1) -> Any:
    """Turns this process's batch into global ``jax.Array`` s with the given shardings.

    With several processes each contributes its rows
    (``jax.make_array_from_process_local_data``); with one, the same layout
    comes from a single batched ``jax.device_put``. A leaf that is already a
    ``jax.Array`` is resharded on the devices if needed, never copied to the host.

    Args:
      batch: a pytree of arrays holding this process's rows of the global batch.
      shardings: a NamedSharding per leaf (the strategy's answer).
      divisor: extra factor the per-shard batch must divide (gradient accumulation).
      data_shards: how many distinct row sets the processes feed
        (``strategy.data_shard(mesh).count``): the global batch is this many
        times a process's rows. Processes that share rows (a model axis spanning
        processes) count once.
    """
    check_batch(batch, shardings, divisor=divisor, data_shards=data_shards)
    return transfer_batch(batch, shardings, data_shards=data_shards)


def check_batch(batch: Any, shardings: Any, *, divisor: int = 1, data_shards: int = 1) -> None:
    """Raises a ShardingError naming the leaf if the batch cannot take ``shardings``.

    Every dimension is checked against its own mesh axes: the global size
    divides the product of their sizes. The rows (dimension 0) also divide
    into ``divisor`` microbatches; the fed dimension (``sharding.fed_dimension``:
    the first one the spec splits) is ``data_shards`` times this process's.
    """

    def check(path: Any, x: Any, sharding: NamedSharding) -> None:
        shape = np.shape(x)
        where = f"batch leaf {jax.tree_util.keystr(path) or '<root>'} with shape {shape}"
        if not shape:
            raise ShardingError(
                f"{where} is a scalar; every batch leaf needs a leading batch dimension. "
                "Give it one (e.g. np.full((batch_size,), value))."
            )
        spec, mesh = sharding.spec, dict(sharding.mesh.shape)
        if len(spec) > len(shape):
            raise ShardingError(
                f"{where}: its batch sharding {spec} on mesh {mesh} has {len(spec)} entries "
                f"for {len(shape)} dimensions. Give the leaf the dimensions the strategy's "
                "batch_sharding splits, or return a spec with one entry per dimension at most."
            )
        sizes = shape if _is_global(x) else global_batch_shape(shape, spec, data_shards)
        for dim, axes in enumerate(dimension_axes(spec, len(shape))):
            parts = math.prod(mesh[a] for a in axes)
            microbatches = divisor if dim == 0 else 1
            size = sizes[dim]
            if size % (parts * microbatches) == 0:
                continue
            if dim == 0:
                accum = f" x {divisor} microbatches" if divisor > 1 else ""
                raise ShardingError(
                    f"{where}: a global batch of {size} rows cannot be split over the batch "
                    f"axes {spec} of mesh {mesh} ({parts} parts{accum}). Use a batch_size "
                    f"divisible by {parts * divisor}, or pad the batch with Trainer.padded "
                    "(a 'mask' marks the padding)."
                )
            raise ShardingError(
                f"{where}: dimension {dim} of global size {size} cannot be split over the "
                f"mesh axes {axes} of its batch sharding {spec} on mesh {mesh} ({parts} "
                f"parts). Make dimension {dim} of every batch divisible by {parts} (pad it), "
                "or split it over other axes in the strategy's batch_sharding."
            )

    jax.tree_util.tree_map_with_path(check, batch, shardings)


def rows_multiple(shardings: Any, *, divisor: int = 1, data_shards: int = 1) -> int:
    """The number a process's batch rows must be a multiple of to take ``shardings``.

    The rows (dimension 0) divide the mesh axes splitting them times
    ``divisor``; a leaf whose fed dimension is the rows needs only its share
    of that, as the global rows are ``data_shards`` times this process's.
    Other dimensions are not rows: ``check_batch`` checks them.
    """

    def one(s: NamedSharding) -> int:
        parts = math.prod(s.mesh.shape[a] for a in dimension_axes(s.spec, 1)[0]) * divisor
        shards = data_shards if fed_dimension(s.spec).dim == 0 else 1
        return parts // math.gcd(parts, shards)

    return math.lcm(1, *(one(s) for s in jax.tree.leaves(shardings)))


def pad_batch(batch: Any, multiple: int) -> Any:
    """``batch`` (a dict of arrays) with its rows padded up to a multiple of ``multiple``,
    and a ``"mask"`` that is 1 on its rows and 0 on the padding.

    Padding repeats the last row, so every value stays one the model can take
    (no ``log(0)``); the mask keeps the padding out of the metrics and, through
    ``masked_mean``, out of the loss. A batch that already has a mask keeps it,
    padded with 0.
    """
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"Only a dict batch can be padded (it carries the 'mask'); got a "
            f"{type(batch).__name__}. Yield dicts, or batches whose rows divide {multiple}."
        )
    rows = len(jax.tree.leaves(batch)[0])
    mask = np.asarray(batch.get("mask", np.ones(rows, np.float32)))
    missing = -rows % multiple
    if not missing:
        return {**batch, "mask": mask}

    def pad(x: Any) -> np.ndarray:
        x = np.asarray(x)
        return np.concatenate([x, np.repeat(x[-1:], missing, axis=0)])

    padded = jax.tree.map(pad, {k: v for k, v in batch.items() if k != "mask"})
    return {**padded, "mask": np.concatenate([mask, np.zeros(missing, mask.dtype)])}


def _is_global(x: Any) -> bool:
    """A jax.Array already laid out over the devices (not this process's host rows)."""
    return isinstance(x, jax.Array) and (jax.process_count() == 1 or not x.is_fully_addressable)


def transfer_batch(batch: Any, shardings: Any, *, data_shards: int = 1) -> Any:
    """Places an already checked batch: no validation, one batched transfer where possible."""
    if jax.process_count() == 1:  # one batched transfer for all leaves
        return jax.device_put(batch, shardings)

    def one(x: Any, sharding: NamedSharding) -> jax.Array:
        if _is_global(x):
            return jax.device_put(x, sharding)
        x = np.asarray(x)
        global_shape = global_batch_shape(x.shape, sharding.spec, data_shards)
        return jax.make_array_from_process_local_data(sharding, x, global_shape)

    return jax.tree.map(one, batch, shardings)


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


# -- changing batches and resuming a data position --------------------------------------
class BatchMismatch(ValueError):
    """A batch unlike the batches before it, which its step (or placement) could not take.

    Raised from the step's own error (``__cause__``) before the step ran, so the
    state is the one after the step before, and ``fit`` can be called again with
    good data. A batch with a new shape that the step does take (a shorter
    sequence a model accepts) is not one: the step just traces again.

    Attributes:
      where: ``"step 7"``, or ``"evaluation batch 3 (after step 7)"``.
      changes: ``(leaf, was, is)`` for each leaf whose dtype or shape changed,
        or that appeared or went missing (``"missing"``).

    Example::

        try:
            trainer.fit(batches, max_steps=100)
        except BatchMismatch as error:
            print(error.where, error.changes)   # step 7 [("['x']", 'float32[8,16]', ...)]
    """

    def __init__(self, message: str, where: str, changes: list[tuple[str, str, str]]) -> None:
        super().__init__(message)
        self.where, self.changes = where, changes


def _leaf_layout(x: Any) -> str:
    """``float32[8,16]``: a leaf's dtype and shape as the messages show them."""
    dtype = getattr(x, "dtype", None)
    name = str(dtype) if dtype is not None else type(x).__name__
    return f"{name}[{','.join(map(str, np.shape(x)))}]"


def batch_layout(batch: Any) -> dict[str, str]:
    """Each leaf's path (``['x']``) and ``_leaf_layout``: what two batches are compared by."""
    return {
        jax.tree_util.keystr(path) or "<root>": _leaf_layout(x)
        for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]
    }


def batch_changes(previous: Any, batch: Any) -> list[tuple[str, str, str]]:
    """``(leaf, was, is)`` for each leaf of ``batch`` unlike ``previous``'s, in path order.

    >>> batch_changes({"x": np.zeros((8, 16), np.float32), "y": np.zeros(8, np.int32)},
    ...               {"x": np.zeros((8, 17), np.float32)})
    [("['x']", 'float32[8,16]', 'float32[8,17]'), ("['y']", 'int32[8]', 'missing')]
    """
    before, now = batch_layout(previous), batch_layout(batch)
    leaves = sorted(before.keys() | now.keys())
    missing = "missing"
    return [
        (leaf, before.get(leaf, missing), now.get(leaf, missing))
        for leaf in leaves
        if before.get(leaf) != now.get(leaf)
    ]


def batch_mismatch(error: Exception, where: str, previous: Any, batch: Any) -> BatchMismatch | None:
    """The ``BatchMismatch`` to raise from ``error``, the failure of ``where`` on ``batch``,
    when ``batch`` differs from ``previous`` (the last batch taken); ``None`` when there is
    nothing to compare (no batch before) or nothing changed (then the error is not the
    batch's layout, and is raised as it is)."""
    if previous is None:
        return None
    changes = batch_changes(previous, batch)
    if not changes:
        return None
    shown = "; ".join(f"{leaf} was {was}, is {now}" for leaf, was, now in changes[:6])
    more = f"; and {len(changes) - 6} more" if len(changes) > 6 else ""
    cause = f"{type(error).__name__}: {error}".splitlines()[0][:300]
    return BatchMismatch(
        f"{where}: the batch differs from the batches before it: {shown}{more} (the step's "
        f"error: {cause}). Every batch needs the leaves and dtypes of the batches before it, "
        "and sizes the model takes (a new size it takes only traces the step again). The "
        "state is the one before this batch: fix the data and call fit again.",
        where,
        changes,
    )


def raise_if_changed(error: Exception, where: str, previous: Any, batch: Any) -> None:
    """Raises ``batch_mismatch(...)`` from ``error`` if there is one; else returns (the
    caller re-raises ``error`` as it is)."""
    mismatch = batch_mismatch(error, where, previous, batch)
    if mismatch is not None:
        raise mismatch from error


class _BatchesTaken:
    """The stand-in for a Grain position saved under another process count."""

    def __repr__(self) -> str:
        return "data.BATCHES_TAKEN"


#: ``RunState.data`` for a Grain position saved under another process count: Grain's
#: files are per process of the old count, so the epoch's iterator is set from the
#: batches the epoch took instead (``seek``).
BATCHES_TAKEN: Any = _BatchesTaken()


class DataPosition(NamedTuple):
    """Where a resumed run continues: the epoch, the batches of it already trained on,
    and the epoch iterator's saved position (``RunState.data``; ``None``: none saved)."""

    epoch: int
    batches: int
    state: Any = None


def _set_position(iterator: Any, position: DataPosition) -> bool:
    """Sets a Grain iterator to ``position``; False when it cannot be (then batches are
    skipped instead)."""
    if not has_position(iterator):
        return False  # the data given now is not a Grain pipeline
    if position.state is BATCHES_TAKEN:
        # Every process of a per-process pipeline (rows[i::n], batched to global/n) has
        # taken the same batches at a step, whatever n: its index follows from them.
        if set(iterator.get_state()) != {"next_index"}:
            return False  # another kind of pipeline
        iterator.set_state({"next_index": position.batches * _index_per_batch(iterator)})
        return True
    state = position.state
    if isinstance(state, bytes) and isinstance(iterator, grain.DatasetIterator):
        state = json.loads(state)  # a step saved before its metadata recorded the position
    iterator.set_state(state)
    return True


def _index_per_batch(iterator: Any) -> int:
    """How far one batch moves a Grain iterator's ``next_index``: 1 where it counts batches
    (``MapDataset.batch(...).to_iter_dataset()``), a batch's rows where it counts rows
    (``to_iter_dataset().batch(...)``). Found by taking one batch, so the caller sets the
    position afterwards."""
    start = int(iterator.get_state()["next_index"])
    next(iterator)
    return int(iterator.get_state()["next_index"]) - start


def seek(iterator: Iterator[Any], position: DataPosition) -> int:
    """Moves a new epoch's iterator to a resumed run's position; the batches it skipped."""
    if position.batches == 0:
        return 0
    if position.state is not None and _set_position(iterator, position):
        return position.batches
    warnings.warn(
        f"Resuming epoch {position.epoch} at batch {position.batches}: train_data has no "
        f"restorable position, so its first {position.batches} batches are read and "
        "discarded (exact, but it costs their loading time). A Grain dataset "
        "(grain.MapDataset / IterDataset / DataLoader) resumes without reading them.",
        stacklevel=6,  # the caller of Trainer.fit
    )
    for skipped in range(position.batches):
        if next(iterator, None) is None:
            raise ValueError(
                f"train_data ended after {skipped} batches while skipping to batch "
                f"{position.batches} of epoch {position.epoch}: it is not the data the "
                "checkpoint was trained on."
            )
    return position.batches


# -- processes that feed the same rows ---------------------------------------------------
_CHUNK = 1 << 20  # bytes weighted at a time: bounds the temporary arrays


def _position_weights(start: int, size: int) -> np.ndarray:
    """An odd, well-mixed ``uint32`` per byte position (murmur3's finaliser of the index).

    Odd, so a change of any one byte always changes the sum; mixed, so swapping two
    rows with equal byte sums (a linear weight's blind spot) changes it too."""
    h = np.arange(start, start + size, dtype=np.uint64).astype(np.uint32)
    h ^= h >> np.uint32(16)
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> np.uint32(13)
    h *= np.uint32(0xC2B2AE35)
    h ^= h >> np.uint32(16)
    return h | np.uint32(1)


def leaf_fingerprint(x: Any) -> int:
    """A ``uint32`` checksum of one host array: its shape and dtype, and the wrapping sum
    of its bytes (row-major) each times a hash of its position.

    A global ``jax.Array`` (laid out over the devices already, the same on every
    process) counts by its shape and dtype alone.
    """
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return zlib.crc32(f"global {x.shape} {x.dtype}".encode())
    array = np.ascontiguousarray(x)
    raw = array.reshape(-1).view(np.uint8)
    total = zlib.crc32(f"{array.shape} {array.dtype}".encode())
    for start in range(0, raw.size, _CHUNK):
        part = raw[start : start + _CHUNK].astype(np.uint32)
        part *= _position_weights(start, part.size)
        total += int(np.sum(part, dtype=np.uint32))
    return total % 2**32


def batch_fingerprint(batch: Any) -> list[int]:
    """One ``leaf_fingerprint`` per leaf of this process's batch, computed on the host.

    Two processes' batches of one structure have equal fingerprints if they are
    equal, and (but for a chance near 2**-32 per leaf) differ if any row does.

    >>> a = {"x": np.arange(6).reshape(3, 2)}
    >>> batch_fingerprint(a) == batch_fingerprint({"x": np.arange(6).reshape(3, 2)})
    True
    >>> batch_fingerprint(a) == batch_fingerprint({"x": np.arange(6).reshape(3, 2)[::-1]})
    False
    """
    return [leaf_fingerprint(x) for x in jax.tree.leaves(batch)]


def same_rows_error(
    shards: Sequence[Sequence[int]],
    fingerprints: Sequence[Sequence[int]],
    leaf_names: Sequence[str],
    *,
    shapes: Sequence[Sequence[tuple[int, ...]]] | None = None,
) -> str | None:
    """What is wrong, if processes that feed the same rows fed different batches.

    ``shards[p]`` is process ``p``'s ``DataShard(index, count)``, ``fingerprints[p]``
    its ``batch_fingerprint`` of a batch of the same structure and ``shapes[p]``
    (optional) that batch's leaf shapes; gathered from every process, so every
    process reaches the same answer. Processes with the same ``index`` must feed
    equal batches; each one whose batch differs from the lowest such process's is
    named. ``None`` when all agree.
    """
    groups: dict[int, list[int]] = {}
    for process, (index, _) in enumerate(shards):
        groups.setdefault(index, []).append(process)
    problems = []
    for index, processes in sorted(groups.items()):
        first = processes[0]
        for process in processes[1:]:
            if list(fingerprints[process]) == list(fingerprints[first]):
                continue
            pairs = zip(leaf_names, fingerprints[process], fingerprints[first], strict=False)
            leaves = [name for name, a, b in pairs if a != b]
            if len(fingerprints[process]) != len(fingerprints[first]):
                leaves.append("(a different number of leaves)")
            what = f"leaves {', '.join(leaves[:4])}"
            if shapes is not None and list(shapes[process]) != list(shapes[first]):
                what += f"; shapes {list(shapes[process])[:4]} against {list(shapes[first])[:4]}"
            problems.append(
                f"process {process} fed a batch unlike process {first}'s ({what}), though "
                f"both feed the rows of DataShard(index={index}, count={shards[process][1]})"
            )
    if not problems:
        return None
    whole = (
        " (count=1: every process feeds the whole global batch; a model axis spans the processes)"
        if {count for _, count in shards} == {1}
        else ""
    )
    return (
        "nnx_spmd_trainer: " + "; ".join(problems) + ". Processes that trainer.placement."
        f"data_shard gives the same index must feed the same rows{whole}, or the step trains "
        "on a global batch nobody fed. Feed each process its data_shard: the index-th of "
        "count equal slices of each global batch (rows[index::count], ds.shard(count, index), "
        "or grain_pipeline), not a slice per process."
    )
