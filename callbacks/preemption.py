"""PreemptionNotice: SIGTERM seen the same way on one process and on many, at any moment."""

from __future__ import annotations

import itertools
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import jax
from jax.experimental import multihost_utils

# Orbax's manager with its preemption checks off: it reaches into Orbax, so it lives with
# the package's other Orbax adapters (imported from here by checkpoint.py as before).
from nnx_spmd_trainer.adapters.orbax_private import QuietManager as QuietManager

#: Set by a SIGTERM this process's Python handler caught, until a check acts on it.
_notice = threading.Event()
#: The value each check gives JAX's sync manager: 1, 2, 3, ... in every process alike.
_checks = itertools.count(1)


def listen_early(noticed: Callable[[], bool] = lambda: False) -> None:
    """Remembers a SIGTERM from now on instead of dying of it (main thread only).

    For entry points, called first: a notice that comes while the program imports,
    builds, restores or compiles is then acted on by the first check of ``fit``
    (``PreemptionNotice``), not lost. In a multi-process job
    ``jax.distributed.initialize`` replaces this handler with XLA's; a notice
    remembered before that is handed over to XLA by ``PreemptionNotice.listen``.
    ``noticed()``, asked once this handler is in place (no gap between the two), says
    whether the handler before it caught a SIGTERM (``nnx_spmd_train``'s, during imports).
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _remember)
        if noticed():
            _notice.set()


def _remember(signum: int, frame: FrameType | None) -> None:
    del signum, frame
    _notice.set()


class PreemptionNotice:
    """Whether the run was asked to stop (SIGTERM), agreed on by every process.

    One process: a Python SIGTERM handler sets a flag (installed by ``listen``,
    removed by ``stop``; ``listen_early`` installs it before anything else).
    Several processes: no Python handler (after ``jax.distributed.initialize``
    it would replace XLA's preemption notifier); ``reached`` asks JAX's sync
    point. JAX sets that point to (highest count any process reported) + 1 when
    a notice arrives, where the count is the value of the last call; so every
    process calls it with the same running count, 1, 2, 3, ... (the global step
    would not do: a resumed run starts past 1, and a notice before its first
    call sets the point to 1, which it would never reach). Every check happens
    at the same point of ``fit`` on every process, so they agree on the check
    that stops the run.
    """

    def __init__(self) -> None:
        self._listening = False
        self._previous: Any = None

    def listen(self) -> None:
        main = threading.current_thread() is threading.main_thread()
        if jax.process_count() > 1:
            if _notice.is_set():  # caught before XLA's handler replaced ours: pass it on
                _notice.clear()
                os.kill(os.getpid(), signal.SIGTERM)
        elif main and not self._listening:
            self._previous = signal.signal(signal.SIGTERM, _remember)
            self._listening = True

    def stop(self) -> None:
        if self._listening:
            # None: a handler from outside Python, which cannot be put back; the default then.
            signal.signal(signal.SIGTERM, self._previous or signal.SIG_DFL)
            self._listening = False

    def reached(self) -> bool:
        """Whether to stop here; call it at the same points in every process."""
        if jax.process_count() > 1:
            try:
                return bool(multihost_utils.reached_preemption_sync_point(next(_checks)))
            except RuntimeError:  # the preemption service is disabled: no notice comes
                return False
        if _notice.is_set():
            _notice.clear()  # one notice stops one fit
            return True
        return False
