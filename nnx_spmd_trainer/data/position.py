"""Where a resumed run's data continues: ``DataPosition`` and ``seek``.

A Grain iterator is set to its saved position (``RunState.data``), or, for a
position saved under another process count (``BATCHES_TAKEN``), to the batches
the epoch took; any other data has the batches already trained on read and
discarded.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from typing import Any, NamedTuple

import grain

from nnx_spmd_trainer.data.prefetch import has_position


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
