"""``BatchMismatch``: a batch unlike the batches before it, named leaf by leaf."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from nnx_spmd_trainer.sharding import ShardingError


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


class BatchShardingMismatch(BatchMismatch, ShardingError):
    """A ``BatchMismatch`` whose cause is a ``ShardingError`` (a ragged last batch the mesh
    cannot split): ``except ShardingError``, which caught it before there was a
    ``BatchMismatch``, still catches it."""


def _leaf_type(x: Any) -> str:
    """``float32[8,16]``: a leaf's type (dtype and shape) as the messages show them."""
    dtype = getattr(x, "dtype", None)
    name = str(dtype) if dtype is not None else type(x).__name__
    return f"{name}[{','.join(map(str, np.shape(x)))}]"


def batch_types(batch: Any) -> dict[str, str]:
    """Each leaf's path (``['x']``) and ``_leaf_type``: what two batches are compared by."""
    return {
        jax.tree_util.keystr(path) or "<root>": _leaf_type(x)
        for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]
    }


def batch_changes(previous: Any, batch: Any) -> list[tuple[str, str, str]]:
    """``(leaf, was, is)`` for each leaf of ``batch`` unlike ``previous``'s, in path order.

    >>> batch_changes({"x": np.zeros((8, 16), np.float32), "y": np.zeros(8, np.int32)},
    ...               {"x": np.zeros((8, 17), np.float32)})
    [("['x']", 'float32[8,16]', 'float32[8,17]'), ("['y']", 'int32[8]', 'missing')]
    """
    before, now = batch_types(previous), batch_types(batch)
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
    batch's leaves, dtypes or shapes, and is raised as it is)."""
    if previous is None:
        return None
    changes = batch_changes(previous, batch)
    if not changes:
        return None
    shown = "; ".join(f"{leaf} was {was}, is {now}" for leaf, was, now in changes[:6])
    more = f"; and {len(changes) - 6} more" if len(changes) > 6 else ""
    cause = f"{type(error).__name__}: {error}".splitlines()[0][:300]
    kind = BatchShardingMismatch if isinstance(error, ShardingError) else BatchMismatch
    return kind(
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
