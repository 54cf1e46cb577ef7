"""LambdaCallback: a callback made of plain functions, Keras-style."""

from __future__ import annotations

from collections.abc import Callable

from nnx_spmd_trainer import Callback, Logs


class LambdaCallback(Callback):
    """Calls the functions it was given from the matching hooks.

    Each function takes the hook's arguments (``logs`` or ``(step|epoch, logs)``).
    The functions are set on the instance, so the trainer dispatches only the
    hooks given: a LambdaCallback with just ``on_epoch_end`` costs nothing per step.

    Example::

        losses = []
        record = LambdaCallback(
            on_train_batch_end=lambda step, logs: losses.append(logs.get("train/loss")))
        Trainer(..., callbacks=[MetricsLogger(10), record])
    """

    def __init__(
        self,
        *,
        on_train_begin: Callable[[Logs], None] | None = None,
        on_train_end: Callable[[Logs], None] | None = None,
        on_epoch_begin: Callable[[int, Logs], None] | None = None,
        on_epoch_end: Callable[[int, Logs], None] | None = None,
        on_train_batch_begin: Callable[[int, Logs], None] | None = None,
        on_train_batch_end: Callable[[int, Logs], None] | None = None,
        on_test_begin: Callable[[Logs], None] | None = None,
        on_test_end: Callable[[Logs], None] | None = None,
        on_test_batch_begin: Callable[[int, Logs], None] | None = None,
        on_test_batch_end: Callable[[int, Logs], None] | None = None,
        order: int = 0,
    ) -> None:
        self.order = order
        hooks = {
            "on_train_begin": on_train_begin,
            "on_train_end": on_train_end,
            "on_epoch_begin": on_epoch_begin,
            "on_epoch_end": on_epoch_end,
            "on_train_batch_begin": on_train_batch_begin,
            "on_train_batch_end": on_train_batch_end,
            "on_test_begin": on_test_begin,
            "on_test_end": on_test_end,
            "on_test_batch_begin": on_test_batch_begin,
            "on_test_batch_end": on_test_batch_end,
        }
        for name, fn in hooks.items():
            if fn is not None:
                setattr(self, name, fn)
