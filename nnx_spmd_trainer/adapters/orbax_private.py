"""Orbax's insides that the checkpoints need, in one place (checked against
orbax-checkpoint 0.12.8; pyproject.toml caps it below 0.13).

Public to ``callbacks/`` (``OrbaxCheckpoint`` and its helpers): the one module through
which they reach past Orbax's public API. ``tests/test_adapters.py`` checks each
assumption against the installed Orbax.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

#: The file Orbax writes into a step's directory once the step is committed
#: (``orbax.checkpoint._src.path.atomicity_types.COMMIT_SUCCESS_FILE``).
COMMIT_MARKER = "commit_success.txt"


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
