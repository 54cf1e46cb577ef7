"""One run writes a directory at a time: an advisory lock that a crash never leaves held."""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path
from types import TracebackType


class DirectoryInUse(RuntimeError):
    """Another live process holds the run lock of the directory."""


class RunLock:
    """An exclusive ``flock`` on ``<directory>/.run.lock``, naming its holder inside.

    Two runs writing one directory lose data (Orbax's temporary directory of a
    step has a fixed name: the second run deletes the first one's save in
    flight), so a second one is refused at once, never made to wait. The kernel
    drops the lock when its process ends, however it ends: a run killed with
    ``kill -9`` does not block the next one. The file itself stays; it is the
    lock, not the sign of one.

    Example::

        with RunLock("runs/a"):   # DirectoryInUse if another run writes there
            ...
    """

    FILE = ".run.lock"

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory).absolute()
        self.path = self.directory / self.FILE
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> RunLock:
        """Takes the lock, or raises ``DirectoryInUse`` naming the process holding it."""
        if self._fd is not None:
            return self
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as error:  # same type (PermissionError, ...), a message with the fix
            raise type(error)(
                error.errno,
                f"cannot write the run lock {self.path} ({error.strerror}): a run must be able "
                "to write its directory. Give one this process can write, or fix its "
                "permissions (ls -ld; a read-only or full file system, an immutable flag).",
            ) from error
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise DirectoryInUse(
                f"{self.directory} is in use by another run ({holder}): two runs writing "
                "one directory destroy each other's checkpoints. Wait for that run to end "
                "or stop it, or give this one another directory."
            ) from None
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {started}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the descriptor drops the flock

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.release()
