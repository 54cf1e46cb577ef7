"""LambdaCallback: a callback made of plain functions, Keras-style."""

from __future__ import annotations

from collections.abc import Callable

from nnx_spmd_trainer import HOOKS, Callback


class LambdaCallback(Callback):
    """Calls the functions it was given from the matching hooks.

    Each function takes the hook's arguments (``logs``, ``(step|epoch, logs)``,
    or ``error`` for ``on_exception``). The functions are set on the instance,
    so the trainer dispatches only the hooks given: a LambdaCallback with just
    ``on_epoch_end`` costs nothing per step.

    Example::

        losses = []
        record = LambdaCallback(
            on_logs=lambda step, logs: losses.append(logs.get("train/loss")))
        Trainer(..., callbacks=[MetricsLogger(10), record])
    """

    def __init__(self, *, order: int = 0, **hooks: Callable[..., None]) -> None:
        unknown = sorted(set(hooks) - set(HOOKS))
        if unknown:
            raise TypeError(
                f"LambdaCallback got {', '.join(unknown)}, which are not hooks; "
                f"the hooks are: {', '.join(HOOKS)}."
            )
        self.order = order
        for name, fn in hooks.items():
            setattr(self, name, fn)
