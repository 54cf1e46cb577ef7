"""Saving a checkpoint step: a failure is one error that names the step and the path.

Orbax reports a failed write as several chained tracebacks from its threads, and
some failures it does not report at all: a step directory it cannot create in its
background thread makes the save wait out a 300 s timeout that names neither the
path nor the cause. Here the directory is checked before each save, and whatever
a write raises, now or in the background, becomes one ``CheckpointWriteError``.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np

from nnx_spmd_trainer.adapters import orbax_private
from nnx_spmd_trainer.distributed import agree


class CheckpointWriteError(OSError):
    """A checkpoint step could not be written; the message names the step, the directory,
    the cause, and the committed steps there (which the failure left as they were)."""


def committed_steps(directory: Path) -> list[int]:
    """The committed steps in ``directory``, read from the disk (Orbax's list may already
    hold the step whose write failed)."""
    with contextlib.suppress(OSError):
        return sorted(
            int(p.name)
            for p in directory.iterdir()
            if p.name.isdigit() and orbax_private.is_committed(p)
        )
    return []


def write_error(directory: Path, step: int | None, reason: str) -> CheckpointWriteError:
    which = f"checkpoint step {step}" if step is not None else "a checkpoint"
    steps = [s for s in committed_steps(directory) if s != step]
    intact = f"steps {steps} there are intact" if steps else "no earlier step is there"
    return CheckpointWriteError(f"could not write {which} to {directory} ({reason}); {intact}")


def _reason(error: BaseException) -> str:
    """The cause in a few words: the OS's, when an ``OSError`` is anywhere in the chain."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.strerror:
            return seen.strerror
        seen = seen.__cause__ or seen.__context__
    first_line = (str(error).strip().splitlines() or [""])[0][:200]
    return f"{type(error).__name__}: {first_line}"


@contextlib.contextmanager
def writing(directory: Path, step: int | None) -> Iterator[None]:
    """Any ``Exception`` raised inside (a write of ``step``, or waiting for one) re-raised
    as one ``CheckpointWriteError``; the original stays chained as its cause."""
    try:
        yield
    except CheckpointWriteError:
        raise
    except Exception as error:
        raise write_error(directory, step, _reason(error)) from error


def check_writable(directory: Path, step: int) -> None:
    """Raises ``CheckpointWriteError`` unless every process can create a file in
    ``directory``. Checked on the main thread before Orbax is called: Orbax creates the
    step directory in a thread, and a failure there leaves the save waiting 300 s."""
    failure = ""
    try:  # a file of this process's own, so processes sharing the directory never collide
        fd, probe = tempfile.mkstemp(prefix=f".write-check-{os.getpid()}-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        failure = f"the directory is not writable: {error.strerror or error}"
    if jax.process_count() > 1:  # every process must take the same branch
        failed = np.flatnonzero(agree.all_values("checkpoint dir not writable", bool(failure)))
        if failed.size and not failure:
            failure = f"the directory is not writable by processes {failed.tolist()}"
    if failure:
        raise write_error(directory, step, failure)
