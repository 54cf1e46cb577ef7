"""The run's directories: checked writable before anything is written, old checkpoints set
aside on a fresh start, and the workdir locked while a run writes there."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import jax

from nnx_spmd_trainer import DirectoryInUse, RunLock
from nnx_spmd_trainer.app import tasks
from nnx_spmd_trainer.app.console import say


def set_old_checkpoints_aside(workdir: Path) -> None:
    """``--config.resume=False`` starts over: earlier checkpoints are moved, never deleted."""
    checkpoints = workdir / "checkpoints"
    if jax.process_index() != 0 or not checkpoints.is_dir() or not any(checkpoints.iterdir()):
        return
    aside = workdir / f"checkpoints.before-{time.strftime('%Y%m%d-%H%M%S')}"
    checkpoints.rename(aside)
    say(f"resume=False: starting over; the earlier checkpoints are now in {aside}")


def check_writable(path: str | os.PathLike[str], flag: str) -> Path:
    """The absolute ``path``; a ``ConfigError`` naming ``flag`` unless it is, or can be
    created as, a directory this process may write to. Writes nothing."""
    path = Path(path).absolute()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent  # the nearest ancestor that exists: where mkdir would write
    if not existing.is_dir():
        where = "it" if existing == path else str(existing)
        raise tasks.ConfigError(
            f"{flag}={path} is not writable: {where} is a file, not a directory; "
            f"pass a {flag} you can write to."
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == path else f" (its parent {existing} is not)"
        raise tasks.ConfigError(
            f"{flag}={path} is not writable{where}: {_why_not_writable(existing)}; "
            f"pass a {flag} you can write to."
        )
    return path


def _why_not_writable(path: Path) -> str:
    """Why ``os.access`` refused: a read-only mount (which stops root too), or permissions."""
    try:
        read_only = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    return "read-only file system" if read_only else "permission denied"


#: What a run writes inside its workdir besides new files: each must stay writable.
WRITTEN_IN_WORKDIR = (
    "config.json",
    "metrics.csv",
    RunLock.FILE,
    "tb",
    "checkpoints",
    f"checkpoints/{RunLock.FILE}",
)


def check_workdir_writable(workdir: Path) -> None:
    """A ``ConfigError`` unless the run can write everywhere in ``workdir`` it would: the
    workdir itself and what an earlier run left there (checkpoints shared read-only, a
    full quota remounted read-only). Writes nothing."""
    check_writable(workdir, "--workdir")
    for name in WRITTEN_IN_WORKDIR:
        path = workdir.absolute() / name
        needed = os.W_OK | os.X_OK if path.is_dir() else os.W_OK
        if path.exists() and not os.access(path, needed):
            raise tasks.ConfigError(
                f"--workdir={workdir.absolute()}: {path} is not writable "
                f"({_why_not_writable(path)}) and this run would write there; make it "
                "writable or pass another --workdir (--dry_run, and evaluating its "
                "checkpoints with OrbaxCheckpoint(...).restore_into, only read it)."
            )


@contextlib.contextmanager
def workdir_lock(workdir: Path) -> Iterator[None]:
    """Process 0 holds the workdir's ``RunLock`` for the run: a second run there is refused."""
    if jax.process_index() != 0:
        yield
        return
    try:
        lock = RunLock(workdir).acquire()
    except DirectoryInUse as error:
        raise tasks.ConfigError(f"--workdir={workdir}: {error}") from None
    with lock:
        yield
