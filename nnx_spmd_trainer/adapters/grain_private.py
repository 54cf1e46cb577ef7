"""Grain's insides that resuming a run needs, in one place (checked against grain 0.2.18;
pyproject.toml caps it below 0.3).

Public to ``callbacks/`` (the checks of a saved data position) as well as the core
(``data.position``). ``tests/test_adapters.py`` checks each assumption against the
installed Grain.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: The one key of a ``MapDataset`` iterator's ``get_state()``: the next element's index.
NEXT_INDEX = "next_index"


def is_index_state(state: Any) -> bool:
    """Whether ``state`` is a ``MapDataset`` iterator's saved state, ``{"next_index": n}``
    (not an ``IterDataset`` input pipeline's, nor a ``DataLoader``'s bytes).

    Private because Grain documents ``get_state()`` as opaque: what it holds is read
    here to resume a position saved under another process count (from the batches
    taken) and to check a saved one. ``grain.experimental.get_next_index`` reads a live
    iterator, not a saved state."""
    return isinstance(state, dict) and state.keys() == {NEXT_INDEX}


def next_index(state: Any) -> Any:
    """The index of an ``is_index_state`` state, as read (a damaged file's may be no int)."""
    return state[NEXT_INDEX]


def state_at(index: int) -> dict[str, int]:
    """The saved state of a ``MapDataset`` iterator whose next element is ``index``
    (for ``set_state``; the inverse of ``next_index``)."""
    return {NEXT_INDEX: index}


def position_file(item_dir: Path, process: int, processes: int) -> Path:
    """The file Grain's checkpoint handler writes process ``process``'s iterator state to,
    in the item directory ``item_dir``: ``process_<i>-of-<n>.json`` (its JSON).

    Private because ``grain.checkpoint.CheckpointHandler`` only writes and reads it; a
    check of the file before the restore (that it is there, parses, and matches what
    the step recorded) needs its name."""
    return item_dir / f"process_{process}-of-{processes}.json"
