"""The data position: where an iterator is, saved, set back and resumed.

``has_position`` tells a Grain iterator (one that saves and sets its position)
from others; ``as_position`` wraps a saved position for Grain's checkpoint
handler; ``look_ahead`` lets a caller read the first batches and leaves the data
where it was. A resumed run's data continues at ``DataPosition`` (``seek``): a
Grain iterator is set to its saved position (``RunState.data``), or, for a
position saved under another process count (``BATCHES_TAKEN``), to the batches
the epoch took; any other data has the batches already trained on read and
discarded.
"""

from __future__ import annotations

import itertools
import json
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import grain

from nnx_spmd_trainer.adapters import grain_private


def has_position(iterator: Any) -> bool:
    """Grain iterators (and anything like them) can save and set their position."""
    return callable(getattr(iterator, "get_state", None)) and callable(
        getattr(iterator, "set_state", None)
    )


class Position(grain.DatasetIterator):
    """A saved position standing in for its iterator in ``grain.checkpoint.CheckpointSave``."""

    def __init__(self, state: Any) -> None:  # no parents: it is never iterated
        self.state = state

    def __next__(self) -> Any:
        raise TypeError("A Position is a saved data position, not an iterator.")

    def get_state(self) -> Any:
        return self.state

    def set_state(self, state: Any) -> None:
        self.state = state

    def close(self) -> None:
        """Nothing to release (a DatasetIterator closes its parents here)."""

    def start_prefetch(self) -> None:
        """Nothing to start (Grain's restore calls it on what it restored into)."""


class _BytesPosition:
    """The same for iterators whose state is bytes (``grain.DataLoader``'s)."""

    def __init__(self, state: bytes) -> None:
        self.state = state

    def get_state(self) -> bytes:
        return self.state

    def set_state(self, state: bytes) -> None:
        self.state = state

    def start_prefetch(self) -> None:
        """Nothing to start (Grain's restore calls it on what it restored into)."""


def as_position(state: Any) -> Any:
    """A data position value (an iterator's ``get_state()``, ``RunState.data``) as an
    object Grain's checkpoint handler takes, like ``Progress.position()``.

    ``grain.checkpoint.CheckpointSave(as_position(run.data))`` saves a run's position;
    ``grain.checkpoint.CheckpointRestore(into)`` with ``into = as_position({})`` (a
    ``DatasetIterator``'s dict; ``as_position(b"")`` for a ``DataLoader``'s bytes) reads
    one back, and ``into.get_state()`` is the value for ``RunState.data``.

    >>> as_position({"next_index": 3}).get_state()
    {'next_index': 3}
    """
    return _BytesPosition(state) if isinstance(state, bytes) else Position(state)


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
        return False  # the data given now is not a Grain input pipeline
    if position.state is BATCHES_TAKEN:
        # Every process of a per-process input pipeline (rows[i::n], batched to global/n) has
        # taken the same batches at a step, whatever n: its index follows from them.
        if not grain_private.is_index_state(iterator.get_state()):
            return False  # another kind of input pipeline
        iterator.set_state(grain_private.state_at(position.batches * _index_per_batch(iterator)))
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
    start = int(grain_private.next_index(iterator.get_state()))
    next(iterator)
    return int(grain_private.next_index(iterator.get_state())) - start


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


def look_ahead(
    data: Iterable[Any], count: int, look: Callable[[Iterable[Any]], Any]
) -> Iterable[Any]:
    """Calls ``look`` with the first ``count`` batches of ``data``; returns data that still
    yields every batch: a re-iterable is iterated afresh, a Grain iterator set back where
    it was, a one-shot iterator's batches put back in front.

    >>> seen = []
    >>> list(look_ahead(iter(range(4)), 2, lambda first: seen.extend(first)))
    [0, 1, 2, 3]
    >>> seen
    [0, 1]
    """
    iterator = iter(data)
    if iterator is not data:  # re-iterable: the caller starts a pass of its own
        look(itertools.islice(iterator, count))
        return data
    if has_position(iterator):  # a Grain iterator: set back where it was
        positioned: Any = iterator
        position = positioned.get_state()
        look(list(itertools.islice(iterator, count)))
        positioned.set_state(position)
        return data
    taken = list(itertools.islice(iterator, count))
    look(taken)
    return itertools.chain(taken, iterator)
