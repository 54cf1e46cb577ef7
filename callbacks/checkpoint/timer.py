"""SaveTimer: whether a checkpoint is due by the clock, one answer for every process; and
the checks of ``OrbaxCheckpoint``'s timing and local-tier settings.

Processes' clocks disagree (they started apart, a step ends at slightly different
moments on each), and a save is a collective: every process must save the same step
or the job hangs. So process 0 alone reads its clock and the others follow its answer
(``distributed.agree.broadcast_from_first``, through the coordination service).

Where it is asked costs something: process 0 only publishes, but the others wait at
the check until process 0 has reached it. The clock is therefore read only at steps
where every process waits for the step anyway: the trainer's log points (where the
metrics leave the devices, so each host waits for the step and, through its
collectives, for the other processes), or every ``check_every_n_steps`` steps when
given. Between those steps nothing is exchanged; a save is late by at most the
distance to the next check.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Protocol

from nnx_spmd_trainer.distributed import agree


class LogPoints(Protocol):
    """What the timer asks of ``trainer.log_schedule`` (a ``LogSchedule``)."""

    @property
    def log_every(self) -> tuple[int, ...]: ...

    def is_log_step(self, step: int) -> bool: ...


class SaveTimer:
    """Due when ``every_s`` seconds have passed since ``restart`` by process 0's clock.

    Args:
      every_s: seconds between saves.
      check_every_n_steps: read the clock after every n-th step; ``None``: at the
        trainer's log points.
      topic: what the processes agree on (one per checkpoint directory).

    >>> timer = SaveTimer(3600.0, check_every_n_steps=10, topic="example")
    >>> timer.restart()
    >>> timer.due(10, log_points=None)  # one process: its own clock, nothing exchanged
    False
    """

    def __init__(self, every_s: float, *, check_every_n_steps: int | None, topic: str) -> None:
        self.every_s = every_s
        self.check_every_n_steps = check_every_n_steps
        self.topic = f"checkpoint due by time: {topic}"
        self._since = time.monotonic()

    def restart(self) -> None:
        """The seconds count from now (a ``fit`` starts, a step was saved)."""
        self._since = time.monotonic()

    def check_refused(self, log_points: LogPoints) -> str | None:
        """Why this timer could never be read with ``log_points``, or None."""
        if self.check_every_n_steps is None and not log_points.log_every:
            return (
                "save_every_n_seconds is checked at the trainer's log points, and this "
                "trainer has none: give Trainer(log_every_n_steps=...) (or a MetricsLogger), "
                "or OrbaxCheckpoint(time_check_every_n_steps=...)."
            )
        return None

    def checks_at(self, step: int, log_points: LogPoints | None) -> bool:
        if self.check_every_n_steps is not None:
            return step % self.check_every_n_steps == 0
        return log_points is not None and log_points.is_log_step(step)

    def due(self, step: int, log_points: LogPoints | None) -> bool:
        """Whether to save after ``step``. Call it after the same steps on every process:
        at a check, every process gets process 0's answer."""
        if not self.checks_at(step, log_points):
            return False
        mine = time.monotonic() - self._since >= self.every_s
        return bool(agree.broadcast_from_first(self.topic, mine))


def local_tier(
    directory: Path, local: str | os.PathLike[str] | None, every_n_steps: int | None
) -> tuple[Path | None, int | None]:
    """``(local_directory, local_every_n_steps)`` checked: both or neither, and apart."""
    if (local is None) != (every_n_steps is None):
        raise ValueError(
            "local_directory and local_every_n_steps go together: give both for a fast "
            "local tier saved every n steps, or neither."
        )
    if local is None or every_n_steps is None:
        return None, None
    if every_n_steps < 1:
        raise ValueError(f"local_every_n_steps must be >= 1, got {every_n_steps}.")
    path = Path(local).absolute()
    if path == directory or directory in path.parents or path in directory.parents:
        raise ValueError(
            f"local_directory {path} and directory {directory} must not hold one another: "
            "each tier lists its own steps. Give two separate directories."
        )
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"local_directory {path} is a file; give a directory.")
    return path, every_n_steps


def save_timer(
    directory: Path, every_s: float | None, check_every_n_steps: int | None
) -> SaveTimer | None:
    """``OrbaxCheckpoint``'s timer from its settings, checked; None when it saves by steps."""
    if check_every_n_steps is not None and check_every_n_steps < 1:
        raise ValueError(f"time_check_every_n_steps must be >= 1, got {check_every_n_steps}.")
    if every_s is None:
        if check_every_n_steps is not None:
            raise ValueError("time_check_every_n_steps needs save_every_n_seconds.")
        return None
    if not every_s > 0 or not math.isfinite(every_s):
        raise ValueError(f"save_every_n_seconds must be a positive number, got {every_s}.")
    return SaveTimer(every_s, check_every_n_steps=check_every_n_steps, topic=str(directory))
