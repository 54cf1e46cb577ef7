"""PreemptionNotice: SIGTERM seen the same way on one process and on many."""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import jax
import orbax.checkpoint as ocp


class PreemptionNotice:
    """Whether the run was asked to stop (SIGTERM), agreed on by every process.

    One process: a Python SIGTERM handler sets a flag, installed by ``listen``
    and removed by ``stop``. Several processes: no handler at all (after
    ``jax.distributed.initialize`` it would replace XLA's preemption notifier);
    Orbax's ``reached_preemption`` is the sync point every process reaches at
    the same step.
    """

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def listen(self) -> None:
        self.requested = False
        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def stop(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def reached(self, step: int, manager: ocp.CheckpointManager) -> bool:
        if jax.process_count() > 1:
            return bool(manager.reached_preemption(step))
        return self.requested

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        del signum, frame
        self.requested = True
