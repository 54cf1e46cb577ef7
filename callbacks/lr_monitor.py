"""LearningRateMonitor: puts the learning rate actually used into ``logs["lr"]``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from typing_extensions import override

from nnx_spmd_trainer import Callback, Logs


def _host_float(value: Any) -> float:
    if isinstance(value, nnx.Variable):
        value = value.get_value()
    return float(np.asarray(jax.device_get(value)))


def _injected(path: tuple[Any, ...], value: Any) -> bool:
    """The value inject_hyperparams used (``hyperparams[...]``), not its schedule's state."""
    del value
    return len(path) > 1 and getattr(path[-2], "name", None) == "hyperparams"


class LearningRateMonitor(Callback):
    """Writes ``logs["lr"]``: the learning rate of the update that produced the current weights.

    Two sources, in this order:

    * ``schedule=fn``: ``fn(step - 1)`` where ``step`` is ``trainer.step`` (the
      optimizer's update count, read on the host), because optax evaluates a
      schedule at the count *before* incrementing it;
    * an optimizer built with ``optax.inject_hyperparams``: the
      ``learning_rate`` hyperparameter it stored, found anywhere in
      ``trainer.optimizer.opt_state`` (``optax.tree.get``). That is the value
      the last update used.

    It writes at log points only: when ``logs`` already holds training
    metrics (a log step or an epoch end, where the devices were just synced
    anyway), and every ``log_every_n_steps`` steps if given. It adds ``lr`` in
    the hook, so every writer sees it in ``on_logs``.

    Example::

        schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 100, 10_000)
        tx = optax.inject_hyperparams(optax.adamw)(learning_rate=schedule)
        Trainer(factory, tx, ..., callbacks=[MetricsLogger(50), LearningRateMonitor(),
                                             TensorBoard("runs/a")])
        # or, without inject_hyperparams: LearningRateMonitor(schedule=schedule)
    """

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        *,
        schedule: Callable[[Any], Any] | None = None,
        key: str = "lr",
    ) -> None:
        if log_every_n_steps is not None and log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps must be >= 1 or None, got {log_every_n_steps}.")
        self.log_every_n_steps = log_every_n_steps
        self.schedule = schedule
        self.key = key

    def learning_rate(self) -> float:
        """The learning rate now (a host computation, or one small device-to-host copy)."""
        if self.schedule is not None:
            return float(np.asarray(self.schedule(max(self.trainer.step - 1, 0))))
        try:
            value = optax.tree.get(
                self.trainer.optimizer.opt_state, "learning_rate", filtering=_injected
            )
        except KeyError:
            raise ValueError(
                "LearningRateMonitor found several 'learning_rate' hyperparameters in the "
                "optimizer state (one per inject_hyperparams); pass "
                "LearningRateMonitor(schedule=the_schedule_to_report)."
            ) from None
        if value is None:
            raise ValueError(
                "LearningRateMonitor found no 'learning_rate' hyperparameter in the optimizer "
                "state. Build the optimizer with optax.inject_hyperparams(optax.adamw)"
                "(learning_rate=...) or pass LearningRateMonitor(schedule=your_schedule)."
            )
        return _host_float(value)

    def _due(self, step: int, logs: Logs) -> bool:
        every = self.log_every_n_steps is not None and step % self.log_every_n_steps == 0
        return every or any(key.startswith("train/") for key in logs)

    @override
    def on_train_batch_end(self, step: int, logs: Logs) -> None:
        if self._due(step, logs):
            logs[self.key] = self.learning_rate()

    @override
    def on_epoch_end(self, epoch: int, logs: Logs) -> None:
        if any(key.startswith("train/") for key in logs):
            logs[self.key] = self.learning_rate()

    @override
    def on_train_end(self, logs: Logs) -> None:
        if any(key.startswith("train/") for key in logs):
            logs[self.key] = self.learning_rate()
