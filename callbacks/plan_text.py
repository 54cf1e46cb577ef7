"""The plan report of the step a run just compiled, for the loggers that record it."""

from __future__ import annotations

import warnings
from typing import Any


def plan_report_for(record: Any, trainer: Any, who: str) -> Any | None:
    """``trainer.plan.report`` for the batch shapes of the step ``record`` (a
    ``StepRecord``, as a callback is handed it: a cache hit of the step just compiled),
    or ``None``, with a warning naming ``who``, where none can be made: a text must never
    stop the run."""
    if record is None:
        return None
    try:
        return trainer.plan.report(record.batch_shapes, train_step=trainer.train_step)
    except Exception as error:  # noqa: BLE001
        warnings.warn(f"{who}: no plan report ({error!r}).", stacklevel=3)
        return None
