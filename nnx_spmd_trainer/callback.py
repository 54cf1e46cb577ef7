"""Callback base, the list that dispatches hooks, and History.

The core calls these hooks; concrete callbacks live in ``nnx_spmd_trainer.callbacks``.
``logs`` always holds host floats. On steps where no callback asked for host
values it is empty: nothing is copied from the devices.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nnx_spmd_trainer.trainer import Trainer

Logs = dict[str, float]


class Callback:
    """Keras-style callback: every hook is a no-op until overridden.

    Callbacks run in ascending ``order`` (stable), so a producer of logs such
    as ``MetricsLogger`` (order -100) runs before the writers that read them.
    ``on_train_batch_begin`` gets the number of steps already done and
    ``on_train_batch_end`` the new count, so step ``n`` is "after n updates".

    >>> class PrintLoss(Callback):
    ...     def on_train_batch_end(self, step, logs):
    ...         if "train/loss" in logs:
    ...             print(step, logs["train/loss"])
    """

    order: int = 0
    trainer: Trainer

    def set_trainer(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, logs: Logs) -> None: ...
    def on_train_end(self, logs: Logs) -> None: ...
    def on_epoch_begin(self, epoch: int, logs: Logs) -> None: ...
    def on_epoch_end(self, epoch: int, logs: Logs) -> None: ...
    def on_train_batch_begin(self, step: int, logs: Logs) -> None: ...
    def on_train_batch_end(self, step: int, logs: Logs) -> None: ...
    def on_test_begin(self, logs: Logs) -> None: ...
    def on_test_end(self, logs: Logs) -> None: ...
    def on_test_batch_begin(self, step: int, logs: Logs) -> None: ...
    def on_test_batch_end(self, step: int, logs: Logs) -> None: ...

    def on_logs(self, step: int, logs: Logs) -> None:
        """Called once after any hook that ends with values in ``logs`` (train batch end,
        epoch end, test end, train end), with the global step: all a log writer needs."""

    def state_dict(self) -> dict[str, Any]:
        """What to checkpoint so a resumed run continues where it stopped."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


class History(Callback):
    """Records every value that lands in ``logs``, with the step it belongs to.

    ``history.history["train/loss"]`` is the list of values and
    ``history.steps["train/loss"]`` the global steps they were logged at.
    """

    order = 1000  # last: sees what every other callback added

    def __init__(self) -> None:
        self.history: dict[str, list[float]] = {}
        self.steps: dict[str, list[int]] = {}

    def on_logs(self, step: int, logs: Logs) -> None:
        for key, value in logs.items():
            steps = self.steps.setdefault(key, [])
            if steps and steps[-1] == step:  # the same value seen by a later hook
                self.history[key][-1] = value
                continue
            steps.append(step)
            self.history.setdefault(key, []).append(value)

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history, "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = {k: list(v) for k, v in state["history"].items()}
        self.steps = {k: list(v) for k, v in state["steps"].items()}


class CallbackList:
    """Dispatches each hook, in order, to the callbacks that override it.

    Skipping the no-op hooks keeps per-step dispatch free for callbacks that
    only act at epoch or train boundaries.
    """

    #: Hooks whose last argument is ``logs``; values left there go on to ``on_logs``.
    LOG_HOOKS = frozenset({"on_train_batch_end", "on_epoch_end", "on_test_end", "on_train_end"})

    def __init__(self, callbacks: Iterable[Callback], trainer: Trainer) -> None:
        self.trainer = trainer
        self.callbacks = sorted(callbacks, key=lambda c: c.order)
        for callback in self.callbacks:
            callback.set_trainer(trainer)
        self._bound: dict[str, list[Callable[..., None]]] = {}

    def __iter__(self) -> Iterator[Callback]:
        return iter(self.callbacks)

    def call(self, hook: str, *args: Any) -> None:
        if hook not in self._bound:
            base = getattr(Callback, hook)
            self._bound[hook] = [
                getattr(c, hook)
                for c in self.callbacks
                if getattr(type(c), hook) is not base
                or hook in vars(c)  # a hook set on the instance (LambdaCallback style)
            ]
        for method in self._bound[hook]:
            method(*args)
        if hook in self.LOG_HOOKS and args[-1]:
            self.call("on_logs", self.trainer.step, args[-1])
