"""Throughput: host wall time per step between log points, without syncing the devices."""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np


def batch_size_and_tokens(batch: Any) -> tuple[int, int | None]:
    """``(examples, tokens)`` of a global batch, from shapes only (no device access).

    Examples are the leading dimension. Tokens are counted when the batch has
    a sequence dimension, recognised as an integer leaf of rank 2
    (``[batch, seq]`` token ids); otherwise ``None``.

    >>> batch_size_and_tokens({"x": np.zeros((8, 4)), "y": np.zeros(8, int)})
    (8, None)
    >>> batch_size_and_tokens({"tokens": np.zeros((8, 128), np.int32)})
    (8, 1024)
    """
    leaves = [leaf for leaf in jax.tree.leaves(batch) if getattr(leaf, "ndim", 0) >= 1]
    if not leaves:
        raise ValueError("The batch has no array with a leading (example) dimension.")
    examples = int(leaves[0].shape[0])
    for leaf in leaves:
        if leaf.ndim == 2 and np.issubdtype(leaf.dtype, np.integer):
            return examples, examples * int(leaf.shape[1])
    return examples, None


class Throughput:
    """Seconds per step between two log points, minus the time spent evaluating.

    Log points are where the devices were synced anyway (metrics were just
    copied to the host), so the wall time between two of them is the time the
    steps in between took; the steps themselves are never waited on.

    >>> timer = Throughput()
    >>> timer.start(step=0)
    >>> timer.seconds_per_step(step=0) is None   # no steps since the last point
    True
    """

    def __init__(self) -> None:
        self._step: int | None = None
        self._time = 0.0
        self._paused_at: float | None = None

    def start(self, step: int) -> None:
        self._step, self._time, self._paused_at = step, time.perf_counter(), None

    def pause(self) -> None:
        """Stops the clock (an evaluation starts)."""
        if self._paused_at is None:
            self._paused_at = time.perf_counter()

    def resume(self) -> None:
        """Restarts the clock; the paused time is not counted."""
        if self._paused_at is not None:
            self._time += time.perf_counter() - self._paused_at
            self._paused_at = None

    def exclude(self, seconds: float) -> None:
        """Leaves ``seconds`` (a compile) out of the current interval."""
        self._time += seconds

    def seconds_per_step(self, step: int) -> float | None:
        """Average since the last call (or ``start``), then restarts from ``step``."""
        now = time.perf_counter() if self._paused_at is None else self._paused_at
        if self._step is None or step <= self._step:
            return None
        seconds = (now - self._time) / (step - self._step)
        self._step, self._time = step, now
        return seconds
