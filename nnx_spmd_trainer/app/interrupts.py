"""Ctrl-C in a run: Orbax's logs kept quiet, and a prompt exit that waits for no stuck thread."""

from __future__ import annotations

import contextlib
import gc
import logging as std_logging
import os
import sys
import threading
from types import FrameType
from typing import NoReturn

from nnx_spmd_trainer.app import python_private


class _OrbaxLog(std_logging.Filter):
    """Orbax logs a failed save with a traceback from each of its threads, though the
    failure reaches the run as one ``CheckpointWriteError``: its lines keep no traceback,
    and after Ctrl-C (which fails the save in flight on purpose) none is kept."""

    interrupted = False

    def filter(self, record: std_logging.LogRecord) -> bool:
        if f"{os.sep}orbax{os.sep}" not in record.pathname:
            return True
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        return not self.interrupted


ORBAX_LOG = _OrbaxLog()


def interrupt(signum: int, frame: FrameType | None) -> None:
    """Ctrl-C: Python's own ``KeyboardInterrupt``, with Orbax's logs quiet from here.

    Raised inside a garbage-collection callback (JAX registers one) or a ``__del__``,
    Python would print it and drop it, and the run would go on: there the signal is sent
    again a moment later, once the callback has returned."""
    ORBAX_LOG.interrupted = True
    if _dropped_if_raised_in(frame):
        threading.Timer(0.01, os.kill, (os.getpid(), signum)).start()
        return
    raise KeyboardInterrupt


def _dropped_if_raised_in(frame: FrameType | None) -> bool:
    """Whether ``frame`` runs inside a ``gc.callbacks`` function or a ``__del__``, where
    Python ignores an exception (prints "Exception ignored in" and goes on)."""
    callbacks = {getattr(callback, "__code__", None) for callback in gc.callbacks}
    while frame is not None:
        if frame.f_code in callbacks or frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def exit_at_once(status: int) -> NoReturn:
    """Ends the process after Ctrl-C: the exit handlers run (JAX's, the logs'), but not
    Python's wait for the threads left or its final garbage collection.

    Ctrl-C inside an Orbax save interrupts Orbax's event loop on the main thread, which
    Orbax then closes with coroutines still suspended in it, and may leave a thread of
    the save waiting for a signal that never comes. At exit, Python would wait for that
    thread (the process hung until killed), and collecting those coroutines runs their
    cleanup on the closed loop ("RuntimeError: Event loop is closed" and "Task was
    destroyed" after the exit line). Nothing of value is left running:
    ``OrbaxCheckpoint.on_exception`` already waited for the save that was in flight, and
    the interrupted one was never committed.
    """
    gc.disable()  # no collection of the interrupted save's coroutines from here on
    with contextlib.suppress(Exception):
        python_private.run_exit_handlers()  # what sys.exit would run, minus the thread joins
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)
