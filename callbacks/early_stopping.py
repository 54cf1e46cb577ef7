"""EarlyStopping: stops fit when a monitored value stops improving."""

from __future__ import annotations

import math
from typing import Any, Literal

from typing_extensions import override

from nnx_spmd_trainer import Callback, Logs


class EarlyStopping(Callback):
    """Stops training (``trainer.request_stop()``) after ``patience`` checks without improvement.

    A check happens whenever ``monitor`` is in ``logs`` during ``fit``: after
    each evaluation for ``"eval/..."`` keys, at each ``MetricsLogger`` log
    point and epoch end for ``"train/..."`` keys. It only reads ``logs``, so it
    never copies anything from the devices itself.

    Args:
      monitor: the ``logs`` key to watch.
      patience: checks without improvement after which training stops (Keras and
        Lightning count the same way: ``patience=0`` stops at the first one).
      mode: ``"min"`` (lower is better) or ``"max"``.
      min_delta: how much a value must beat the best to count as improvement.

    Attributes:
      best: the best value seen (``None`` before the first check).
      best_step: the global step it was seen at.
      wait: checks since the last improvement.
      stopped_step: the global step at which training was stopped, or ``None``.

    Example::

        stop = EarlyStopping(monitor="eval/loss", patience=3, min_delta=1e-3)
        trainer = Trainer(..., callbacks=[stop])
        trainer.fit(train, eval_data=val, max_steps=10_000, eval_every_n_steps=200)
        stop.stopped_step   # e.g. 1400, or None if it ran to max_steps
    """

    def __init__(
        self,
        monitor: str = "eval/loss",
        *,
        patience: int = 3,
        mode: Literal["min", "max"] = "min",
        min_delta: float = 0.0,
    ) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}.")
        if patience < 0 or min_delta < 0:
            raise ValueError(f"patience and min_delta must be >= 0, got {patience}, {min_delta}.")
        self.monitor = monitor
        self.state_key = f"EarlyStopping[{monitor},{mode}]"  # one per monitored value
        self.patience = patience
        self.mode = mode
        self.min_delta = min_delta
        self.best: float | None = None
        self.best_step: int | None = None
        self.wait = 0
        self.stopped_step: int | None = None
        self._fitting = False

    def improved(self, value: float) -> bool:
        """Whether ``value`` beats the best by more than ``min_delta`` (NaN never does)."""
        if math.isnan(value):
            return False
        if self.best is None:
            return True
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def _check(self, logs: Logs) -> None:
        step = self.trainer.step
        # Only during fit: a standalone trainer.evaluate() must not stop a later fit.
        if not self._fitting or self.monitor not in logs:
            return
        value = float(logs[self.monitor])
        if self.improved(value):
            self.best, self.best_step, self.wait = value, step, 0
            return
        self.wait += 1
        if self.wait >= self.patience:
            self.stopped_step = step
            self.trainer.request_stop()

    @override
    def on_train_begin(self, logs: Logs) -> None:
        self._fitting = True

    @override
    def on_train_end(self, logs: Logs) -> None:
        self._fitting = False

    @override
    def on_exception(self, error: BaseException) -> None:
        self._fitting = False

    @override
    def on_logs(self, step: int, logs: Logs) -> None:
        self._check(logs)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "best": self.best,
            "best_step": self.best_step,
            "wait": self.wait,
            "stopped_step": self.stopped_step,
        }

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = None if state["best"] is None else float(state["best"])
        self.best_step = state["best_step"]
        self.wait = int(state["wait"])
        self.stopped_step = state["stopped_step"]
