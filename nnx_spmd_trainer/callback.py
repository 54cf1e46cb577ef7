"""The callbacks' public surface: ``Callback``, ``CallbackList``, ``History``, ``HOOKS``, ``Logs``.

``Callback`` is what a user subclasses: the engine's ``BaseCallback`` (``engine/hooks.py``:
the hooks, their dispatch, ``History``) with ``self.trainer`` typed as the real ``Trainer``,
so ``self.trainer.plan`` and ``.run`` type-check in every callback. What a hook needs of
the step just taken it is handed: ``self.step_record`` (a ``StepRecord``).

Why here (the layers in pyproject's ``[tool.importlinter]``): a callback knows the
trainer, and the trainer holds callbacks. This module is the top layer, above
``trainer.py``: it imports the ``Trainer`` and the engine's hooks, and only the package's
``__init__`` imports it (callbacks take ``Callback`` from the package). The ``Trainer``
holds its callbacks as ``BaseCallback`` objects in the engine's ``CallbackList``, which
asks of it only a ``HookHost`` (its step and its run's timings): neither ``trainer.py``
nor the engine imports this module, so no import circle is left, ``TYPE_CHECKING`` ones
included. One consequence: the trainer's own ``History`` is a ``BaseCallback``, not a
``Callback``.

The logs flow one way. The trainer alone decides when training
metrics leave the devices (its log steps, epoch ends, the end of ``fit``) and
puts them in ``logs`` *before* it calls a hook; evaluation values arrive the
same way at ``on_test_end``. A hook may add values of its own (the learning
rate, a norm). Once every callback has run the hook, ``on_logs(step, logs)``
hands the finished ``logs`` to the writers, read-only. ``logs`` always holds
host floats; on steps that are not log steps it is empty and nothing is
copied from the devices.
"""

from __future__ import annotations

from nnx_spmd_trainer.engine.hooks import HOOKS, BaseCallback, CallbackList, History, Logs
from nnx_spmd_trainer.trainer import Trainer

__all__ = ["HOOKS", "Callback", "CallbackList", "History", "Logs"]


class Callback(BaseCallback[Trainer]):
    """Keras-style callback: every hook is a no-op until overridden; ``self.trainer`` is the
    ``Trainer`` that runs it (set when the trainer is built).

    ``on_train_batch_begin`` gets the number of steps already done and
    ``on_train_batch_end`` the new count, so step ``n`` is "after n updates".
    Callbacks run in the order given (a stable sort on ``order``, 0 by default).
    An ``on_...`` method whose name is close to a hook's is a typo and an error.

    Attributes:
      order: sort key for dispatch; callbacks with equal ``order`` keep their list order.
      state_key: the key of this callback's ``state_dict`` in a checkpoint; two
        callbacks with state must have different keys (set it to tell two
        instances of one class apart).
      goodput: the part of ``fit``'s wall time this callback's hooks count as
        (``"callbacks"``; a checkpoint callback: ``"checkpoint"``).
      step_record: the last training step (``StepRecord``: ``step``, ``loss`` still on
        the devices, ``batch_shapes``, host timings), handed to every callback before
        that step's ``on_train_batch_end``; ``None`` before the trainer's first step.
        Keeping it or its loss costs no device sync (``trainer.last_step`` is the same).
      needs_batch: set ``True`` on a callback that reads the placed batch itself: it is
        then handed each step's global batch as ``step_batch``, beside ``step_record``.
        Off by default: a batch kept by a callback holds device memory until the next step.
      step_batch: the last training step's placed global batch (arrays sharded as the
        plan lays batches out), for a callback whose ``needs_batch`` is ``True``; else
        ``None``.

    >>> class PrintLoss(Callback):
    ...     def on_logs(self, step, logs):
    ...         if "train/loss" in logs:
    ...             print(step, logs["train/loss"])
    >>> class FirstRows(Callback):
    ...     needs_batch = True  # be handed each step's placed batch
    ...     def on_train_batch_end(self, step, logs):
    ...         self.rows = self.step_batch["x"][:2]
    """

    # No hook is defined here: the dispatch compares each hook with BaseCallback's no-op.
