"""Gloo's "connected to N peer ranks" notes, dropped from output lines and from standard output."""

from __future__ import annotations

import atexit
import contextlib
import os
import select
import sys
import threading

GLOO_PIECES = (
    "[Gloo] Rank ",
    " is connected to ",
    " peer ranks. ",
    "Expected number of connected peer ranks is : ",
)


class GlooNotes:
    """Drops Gloo's "[Gloo] Rank r is connected to n peer ranks. ..." notes from output lines.

    Gloo writes each note in eight pieces (text, numbers, the newline), each a write of its
    own, from the thread forming a group; groups formed at once interleave their pieces.
    So one line can hold pieces of several notes, and a later line only a note's tail (its
    last number, or nothing): each note ends in exactly one newline, so a line that starts
    k notes leaves k - 1 tails to come, dropped while they are bare numbers.
    """

    def __init__(self) -> None:
        self._tails = 0

    def keep(self, line: str) -> str | None:
        """``line`` without Gloo's pieces (``None``: nothing else was in it)."""
        body = line.rstrip("\n")
        if "[Gloo] Rank " in body or "peer ranks" in body:
            self._tails = max(0, self._tails + body.count("[Gloo] Rank ") - 1)
            for piece in GLOO_PIECES:
                body = body.replace(piece, "")
            if not body.replace(" ", "").isdigit() and body.strip():
                return body + "\n"  # someone else's text, written into Gloo's line
            return None
        if self._tails and (body.strip().isdigit() or not body.strip()):
            self._tails -= 1
            return None
        return line


class QuietStdout:
    """Standard output (file descriptor 1) through a pipe and a thread that drops Gloo's
    notes: Gloo writes them from C++ straight to the descriptor, past ``sys.stdout``.

    ``stop`` (at exit, and before ``PeerWatch`` ends the process) puts the descriptor back
    and waits for the thread to pass on everything still in the pipe. A partial line is
    passed on after 50 ms without more output, so a prompt is not held back.
    """

    IDLE_S = 0.05

    def __init__(self) -> None:
        self._saved: int | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._saved is not None:
            return
        sys.stdout.flush()
        read, write = os.pipe()
        self._saved = os.dup(1)
        os.dup2(write, 1)
        os.close(write)
        self._thread = threading.Thread(
            target=self._pump, args=(read, self._saved), name="nnx-spmd-quiet-stdout", daemon=True
        )
        self._thread.start()
        atexit.register(self.stop)  # before JAX's own exit handler, registered earlier

    def stop(self) -> None:
        if self._saved is None or self._thread is None:
            return
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        os.dup2(self._saved, 1)  # the pipe's last writer closes: the thread reads to its end
        self._thread.join(timeout=2)  # longer only if a child process holds the pipe
        self._saved = None

    @staticmethod
    def _pump(read: int, out: int) -> None:
        notes, partial = GlooNotes(), b""

        def emit(data: bytes) -> None:
            while data:
                data = data[os.write(out, data) :]

        with contextlib.suppress(OSError):
            while True:
                if not select.select([read], [], [], QuietStdout.IDLE_S)[0]:
                    if partial and b"Gloo" not in partial and not partial.strip().isdigit():
                        emit(partial)  # a line in the making, not Gloo's: do not hold it
                        partial = b""
                    continue
                chunk = os.read(read, 1 << 16)
                if not chunk:
                    break
                *lines, partial = (partial + chunk).split(b"\n")
                for line in lines:
                    kept = notes.keep(line.decode(errors="replace") + "\n")
                    if kept is not None:
                        emit(kept.encode())
            kept = notes.keep(partial.decode(errors="replace")) if partial else None
            if kept:
                emit(kept.encode())
        os.close(read)


QUIET_STDOUT = QuietStdout()
