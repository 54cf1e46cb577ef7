"""Orbax's insides that the checkpoints need, in one place (checked against
orbax-checkpoint 0.12.8; pyproject.toml caps it below 0.13).

Public to ``callbacks/`` (``OrbaxCheckpoint`` and its helpers): the one module through
which they reach past Orbax's public API. ``tests/test_adapters.py`` checks each
assumption against the installed Orbax.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

#: The file Orbax writes into a step's directory once the step is committed
#: (``orbax.checkpoint._src.path.atomicity_types.COMMIT_SUCCESS_FILE``).
COMMIT_MARKER = "commit_success.txt"
#: A step's own metadata file (``orbax.checkpoint._src.metadata.checkpoint
#: ._STEP_METADATA_FILENAME``): every saved step has it, and a manager reads it (the commit
#: time) for every step it lists, warning ``Metadata file does not exist`` where it is gone.
STEP_METADATA = "_CHECKPOINT_METADATA"


def is_committed(step_dir: Path) -> bool:
    """Whether Orbax finished writing the step in ``step_dir`` (its ``COMMIT_MARKER`` is
    there).

    Private because the public ``ocp.step.is_checkpoint_finalized`` asks only whether
    the directory was renamed from its temporary name on a local disk: a finished step
    whose marker was deleted (or a directory copied half-way) passes it. The marker is
    written last on every file system (0.12.8), so its presence is the stricter test."""
    return (step_dir / COMMIT_MARKER).exists()


class JsonWrittenLater(ocp.JsonCheckpointHandler):
    """Orbax's JSON item, whose value is made in Orbax's background commit: the item saved
    is handed to ``to_json`` there (which may wait for the devices), and its result is
    written. Subclasses override ``to_json``.

    Overrides the private ``JsonCheckpointHandler._save_fn(x, directory)``, the coroutine
    Orbax's commit thread runs to write the file: the public ``async_save`` turns the
    item into JSON text before it returns, in the saving thread, so a value computed on
    the devices would block the save. Writing a whole ``AsyncCheckpointHandler``
    instead would copy Orbax's primary-host and commit-future logic."""

    def to_json(self, item: Any) -> Any:
        """The JSON value to write for ``item`` (run in the background commit)."""
        return item

    async def _save_fn(self, x: Any, directory: Any) -> None:
        await super()._save_fn(self.to_json(x), directory)


class QuietManager(ocp.CheckpointManager):
    """Orbax's ``CheckpointManager``, whose own preemption checks stay away from JAX.

    Orbax asks ``reached_preemption(step)`` inside ``save`` and its background
    finalize, with the step number: each call sets the count JAX's sync manager
    compares to ``step``. The sync point is (highest count) + 1, so those calls,
    from the main thread or not, would move it off ``PreemptionNotice``'s count
    and the processes would never reach it. Saves for a preemption are forced, so
    nothing here needs the answer.

    The method is public, but that Orbax calls it from ``save`` and finalize (and
    nowhere else that matters here) is its inside: ``CheckpointManagerOptions`` has no
    switch to keep it from JAX's sync manager.
    """

    def reached_preemption(self, step: int) -> bool:
        del step
        return False


_CLOSED_LOOP = "Event loop is closed"
_quieted = False


def quiet_reads_after_a_failed_restore() -> None:
    """Orbax closes its event loop when a restore fails while TensorStore reads of the
    same step are still in flight; each read that ends afterwards reports
    ``RuntimeError: Event loop is closed`` as an unraisable exception from TensorStore's
    callback (nothing is lost: the step is already known to be unreadable and set
    aside). Installs, once (``OrbaxCheckpoint`` does, when made), a ``sys.unraisablehook``
    that drops exactly those (no object, that message) and hands every other one to the
    hook before it."""
    global _quieted
    if _quieted:
        return
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        error = unraisable.exc_value
        closed = isinstance(error, RuntimeError) and str(error) == _CLOSED_LOOP
        if not (closed and unraisable.object is None):
            previous(unraisable)

    sys.unraisablehook = hook
    _quieted = True


def lacks_step_metadata(step_dir: Path) -> bool:
    """Whether ``step_dir`` lost its ``STEP_METADATA`` file: no save leaves a step so (it
    is written before the step is committed), but Orbax's deletion of an old step, killed
    half-way, does: it removes the step's files in no set order, the top ones first when
    it deletes in parallel."""
    return step_dir.is_dir() and not (step_dir / STEP_METADATA).exists()


class _ListingNotes(logging.Filter):
    """Orbax's warnings while a manager opens or lists its steps that say nothing to the
    user: the read-only notes (a manager opened read-only on purpose, to read) and the
    missing metadata of steps already known as leftovers (``known``)."""

    READ_ONLY = ("CheckpointManagerOptions.read_only=True", "Given directory is read only")
    MISSING = "Metadata file does not exist"

    def __init__(self, known: Collection[Path]) -> None:
        super().__init__()
        self.known = {str(step_dir / STEP_METADATA) for step_dir in known}

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if message.startswith(self.READ_ONLY):
            return False
        if message.startswith(self.MISSING) and record.args:
            args = record.args if isinstance(record.args, tuple) else (record.args,)
            return str(args[0]) not in self.known
        return True


@contextlib.contextmanager
def quiet_listing(leftovers: Collection[Path] = ()) -> Iterator[None]:
    """Orbax's notes dropped while the block opens a manager or reloads its steps (absl's
    logger, Orbax's messages as of 0.12.8): the read-only notes, and the missing metadata
    of the step directories in ``leftovers``. Nothing else is dropped, and nothing after
    the block: importing or using the checkpoints leaves the logging as it was."""
    notes = _ListingNotes(leftovers)
    absl_logger = logging.getLogger("absl")
    absl_logger.addFilter(notes)
    try:
        yield
    finally:
        absl_logger.removeFilter(notes)


class _FailedReads(logging.Filter):
    """asyncio's report of a TensorStore read of ``step_dir`` whose failure Orbax never
    collected (the restore already failed on another read of the same step)."""

    NOTE = "Future exception was never retrieved"

    def __init__(self, step_dir: Path) -> None:
        super().__init__()
        self.step_dir = str(step_dir)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith(self.NOTE) and self.step_dir in message)


@contextlib.contextmanager
def quiet_failed_reads(step_dir: Path) -> Iterator[None]:
    """While the block reads the step in ``step_dir``: when one of Orbax's concurrent
    reads fails, the restore raises that failure, and the others' failures, never
    collected, are each logged by asyncio as ``Future exception was never retrieved``
    with a traceback (0.12.8). The step is reported once, by whoever catches the
    restore's error; those records (about this step alone) are dropped."""
    notes = _FailedReads(step_dir)
    asyncio_logger = logging.getLogger("asyncio")
    asyncio_logger.addFilter(notes)
    yield
    # Only a read that went well takes the filter off. The failed reads' futures are
    # logged when the garbage collector reaches them, which may be long after the
    # restore's error was caught (CI saw it): the filter then stays for the process,
    # dropping only records about this damaged step.
    asyncio_logger.removeFilter(notes)
