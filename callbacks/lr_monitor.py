"""LearningRateMonitor: puts the learning rate actually used into ``logs["lr"]``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx
from typing_extensions import override

from nnx_spmd_trainer import Callback, Logs


def find_hyperparam(opt_state: Any, name: str = "learning_rate") -> Any | None:
    """The first ``hyperparams[name]`` inside an optimizer state, or ``None``.

    ``optax.inject_hyperparams`` keeps its hyperparameters in a ``hyperparams``
    dict of its state, which may sit anywhere in a chain, a ``multi_transform``
    or a wrapper, so the whole pytree of containers is searched.
    """
    stack = [opt_state]
    while stack:
        node = stack.pop()
        hyperparams = getattr(node, "hyperparams", None)
        if isinstance(hyperparams, Mapping) and name in hyperparams:
            return hyperparams[name]
        if isinstance(node, Mapping):
            stack.extend(reversed(list(node.values())))
        elif isinstance(node, tuple | list):  # NamedTuple states included
            stack.extend(reversed(node))
    return None


def _host_float(value: Any) -> float:
    if isinstance(value, nnx.Variable):
        value = value.get_value()
    return float(np.asarray(jax.device_get(value)))


class LearningRateMonitor(Callback):
    """Writes ``logs["lr"]``: the learning rate of the update that produced the current weights.

    Two sources, in this order:

    * ``schedule=fn``: ``fn(count - 1)`` where ``count`` is the optimizer's
      update count (``trainer.optimizer.step``), because optax evaluates a
      schedule at the count *before* incrementing it;
    * an optimizer built with ``optax.inject_hyperparams``: the
      ``hyperparams["learning_rate"]`` it stored, found anywhere in
      ``trainer.optimizer.opt_state``. That is the value the last update used.

    It writes at log points only: when ``logs`` already holds training
    metrics (a ``MetricsLogger`` step or an epoch end, where the devices were
    just synced anyway), and every ``log_every_n_steps`` steps if given.
    It runs after ``MetricsLogger`` and before the writers (``order = -90``).

    Example::

        schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 100, 10_000)
        tx = optax.inject_hyperparams(optax.adamw)(learning_rate=schedule)
        Trainer(factory, tx, ..., callbacks=[MetricsLogger(50), LearningRateMonitor(),
                                             TensorBoard("runs/a")])
        # or, without inject_hyperparams: LearningRateMonitor(schedule=schedule)
    """

    order = -90

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
        """Reads the learning rate now (one small device-to-host copy)."""
        optimizer = self.trainer.optimizer
        if self.schedule is not None:
            count = int(_host_float(optimizer.step))
            return float(np.asarray(self.schedule(max(count - 1, 0))))
        value = find_hyperparam(optimizer.opt_state)
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
