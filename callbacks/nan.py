"""TerminateOnNaN: stops fit at the first non-finite loss, and names the step."""

from __future__ import annotations

import warnings
from typing import Any

import jax
import numpy as np
from typing_extensions import override

from nnx_spmd_trainer import Callback, Logs


class TerminateOnNaN(Callback):
    """Stops training when the loss becomes NaN or infinite.

    Every step it keeps a reference to ``trainer.last_loss`` (the step's loss,
    still on device: keeping it costs no copy). Every ``check_every_n_steps``
    steps, and at every log point (where ``logs`` already holds
    ``"train/loss"``), epoch end and the end of fit, it copies the kept losses
    to the host in one transfer and finds the *first* non-finite one, so the
    step it reports is exact even when it checks rarely. Steps in between
    touch nothing on the devices.

    Contract with checkpointing (and any other callback that must not persist
    a diverged state): on detection it sets ``trainer.stop_training = True``
    and ``trainer.nonfinite_step = <global step>``; ``trainer.nonfinite_step``
    is ``None`` until then. A checkpoint callback must skip saving while
    ``trainer.nonfinite_step is not None``. This callback
    runs early (``order = -80``: after ``MetricsLogger``, before writers and
    checkpoints at order 0), so within any hook where it checks, a later
    callback already sees the flag. With ``check_every_n_steps=n > 1`` only
    steps that are multiples of ``n`` (and epoch/fit ends) are checked: save
    checkpoints at multiples of ``n`` for the guarantee to hold.

    Attributes:
      stopped_step: the global step whose loss was first non-finite, or ``None``
        (reset, with ``trainer.nonfinite_step``, when a new ``fit`` begins).

    Example::

        nan_guard = TerminateOnNaN(check_every_n_steps=10)
        trainer = Trainer(..., callbacks=[nan_guard, OrbaxCheckpoint(..., save_every_n_steps=100)])
        trainer.fit(batches, max_steps=10_000)
        nan_guard.stopped_step   # None, or the step where the loss went NaN
    """

    order = -80

    def __init__(self, check_every_n_steps: int = 1) -> None:
        if check_every_n_steps < 1:
            raise ValueError(f"check_every_n_steps must be >= 1, got {check_every_n_steps}.")
        self.check_every_n_steps = check_every_n_steps
        self.stopped_step: int | None = None
        self._pending: list[tuple[int, jax.Array]] = []

    def _stop(self, step: int, value: float) -> None:
        self._pending.clear()
        self.stopped_step = step
        self.trainer.stop_training = True
        self.trainer.nonfinite_step = step
        warnings.warn(
            f"TerminateOnNaN: the loss is {value} at step {step}; training stopped at step "
            f"{self.trainer.step}. Checkpoints after this point must not be saved.",
            RuntimeWarning,
            stacklevel=2,
        )

    def _check_pending(self) -> bool:
        if not self._pending:
            return False
        steps = [step for step, _ in self._pending]
        losses = np.asarray(jax.device_get([loss for _, loss in self._pending]), np.float64)
        self._pending.clear()
        bad = np.flatnonzero(~np.isfinite(losses))
        if bad.size:
            self._stop(steps[bad[0]], float(losses[bad[0]]))
            return True
        return False

    def _check(self) -> None:
        if self.stopped_step is None:
            self._check_pending()

    @override
    def on_train_begin(self, logs: Logs) -> None:
        # A new fit (typically after restoring a good checkpoint) starts clean.
        self._pending.clear()
        self.stopped_step = None
        self.trainer.nonfinite_step = None

    @override
    def on_train_batch_end(self, step: int, logs: Logs) -> None:
        if self.stopped_step is not None:
            return
        assert self.trainer.last_loss is not None
        self._pending.append((step, self.trainer.last_loss))
        # At a log point the devices were just synced for the metrics: checking is free.
        if step % self.check_every_n_steps == 0 or "train/loss" in logs:
            self._check()

    @override
    def on_epoch_end(self, epoch: int, logs: Logs) -> None:
        self._check()

    @override
    def on_train_end(self, logs: Logs) -> None:
        self._check()
        self._pending.clear()

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"stopped_step": self.stopped_step}

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stopped_step = state["stopped_step"]
