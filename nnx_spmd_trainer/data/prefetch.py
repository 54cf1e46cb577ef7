"""Batches placed on the devices ahead of the steps, with the data position kept exact.

A background thread takes host batches from the epoch's iterator and places
them (``Placement.place``) while the current step runs. The iterator then runs
ahead of training, so the position a checkpoint saves is the one recorded
after the last batch a step *took*, and closing the prefetch sets the
iterator back to it: nothing is skipped or taken twice.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, NoReturn

from nnx_spmd_trainer.data.position import as_position, has_position

_END = object()


class Prefetch:
    """``(host_batch, placed_batch)`` pairs from ``iterator``, ``depth`` placed ahead.

    With ``depth=0`` nothing runs ahead: each batch is taken and placed when
    asked for. ``waiting()`` is a context manager around each wait for a batch
    (taking, and placing when not ahead): the trainer times it. ``explain(host, error)``,
    called in the loop's thread when placing ``host`` raised ``error``, returns a better
    error to raise from it (the trainer names the step and what changed), or ``None``.
    """

    def __init__(
        self,
        iterator: Any,  # an iterator; with get_state/set_state when positioned
        place: Callable[[Any], Any],
        depth: int,
        *,
        waiting: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
        explain: Callable[[Any, Exception], Exception | None] = lambda host, error: None,
    ) -> None:
        self.iterator = iterator
        self.place, self.depth, self.waiting = place, depth, waiting
        self.explain = explain
        self.positioned = has_position(iterator)
        self._position = self.iterator.get_state() if self.positioned and depth else None
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if depth:
            self._thread = threading.Thread(target=self._fill, name="prefetch", daemon=True)
            self._thread.start()

    def __iter__(self) -> Prefetch:
        return self

    def __next__(self) -> tuple[Any, Any]:
        with self.waiting():
            if self._thread is None:
                host = next(self.iterator)
                try:
                    return host, self.place(host)
                except Exception as placing:
                    self._failed(host, placing)
            item = self._queue.get()
        if item is _END:
            self._queue.put(_END)  # asked again, it ends again
            raise StopIteration
        host, placed, state, error = item
        if error is not None:
            if host is not _END:  # placing it failed, not taking it
                self._failed(host, error)
            raise error
        self._position = state
        return host, placed

    def _failed(self, host: Any, error: Exception) -> NoReturn:
        better = self.explain(host, error)
        if better is None:
            raise error
        raise better from error

    def position(self) -> Any:
        """What ``grain.checkpoint.CheckpointSave`` saves: where the next step's batch starts."""
        if self._thread is None:
            return self.iterator
        return as_position(self._position)

    def close(self) -> None:
        """Stops taking batches and sets the iterator back to the last batch a step took."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        if self.positioned:
            self.iterator.set_state(self._position)

    def _fill(self) -> None:
        try:
            for host in self.iterator:
                state = self.iterator.get_state() if self.positioned else None
                try:
                    placed = self.place(host)
                except Exception as error:  # raised to the loop when it reaches this batch
                    self._put((host, None, None, error))
                    return
                if not self._put((host, placed, state, None)):
                    return
        except Exception as error:  # the iterator's own: no batch to explain
            self._put((_END, None, None, error))
            return
        self._put(_END)

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False
