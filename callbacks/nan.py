"""TerminateOnNaN: stops fit at the first non-finite loss, and names the step."""

from __future__ import annotations

import warnings

import jax
import numpy as np
from typing_extensions import override

from nnx_spmd_trainer import Callback, Logs


class TerminateOnNaN(Callback):
    """Stops training when the loss becomes NaN or infinite, and names the step.

    Every step it keeps a reference to the step's loss (``self.step_record.loss``, the
    ``StepRecord`` it is handed: still on device, no copy). Every ``check_every_n_steps`` steps it
    copies to the host, in one transfer, only the kept losses of steps the trainer has
    already waited for (those at least ``trainer.placement.max_steps_in_flight`` steps
    old), so checking never stalls the steps in flight; at log points, epoch ends and the end
    of fit, where the devices are synced anyway, it checks them all. The step it
    reports is the *first* non-finite one, exactly; training stops a few
    steps after it.

    Contract with checkpointing (and anything else that must not persist a
    diverged state): on detection it calls
    ``trainer.request_stop(nonfinite_step=<first bad step>)``. A checkpoint callback must
    skip saving while ``trainer.progress.nonfinite_step is not None``, and must check
    that the loss of the step it saves is finite (``step_record.loss``: saving
    waits for that step anyway), which covers the few steps not yet checked
    here. Losses of a diverged model stay non-finite, so no NaN state is saved.

    The weights it leaves in memory: by default those after the step it stopped
    at, which went through the non-finite step's update (NaN, typically); with
    ``Trainer(skip_nonfinite_updates=True)`` a step whose loss or new parameters
    are not finite changes neither the weights nor the optimizer's state, so they
    are the last finite weights, to evaluate or save. The warning says which.
    (Restoring the last finite step's state here instead would need a copy of the
    state for every step in flight, or a host sync each step: the skip costs neither.)

    Attributes:
      stopped_step: the first step whose loss was not finite, or ``None``
        (reset, with ``trainer.progress.nonfinite_step``, when a new ``fit`` begins).

    Example::

        nan_guard = TerminateOnNaN()
        trainer = Trainer(..., callbacks=[nan_guard, MetricsLogger(50)])
        trainer.fit(batches, max_steps=10_000)
        nan_guard.stopped_step   # None, or the step where the loss went NaN
    """

    def __init__(self, check_every_n_steps: int = 1) -> None:
        if check_every_n_steps < 1:
            raise ValueError(f"check_every_n_steps must be >= 1, got {check_every_n_steps}.")
        self.check_every_n_steps = check_every_n_steps
        self.stopped_step: int | None = None
        self._pending: list[tuple[int, jax.Array]] = []

    def check(self, *, through_step: int | None = None) -> int | None:
        """Checks the kept losses up to ``through_step`` (all by default); returns the bad step."""
        if self.stopped_step is not None:
            return self.stopped_step
        due = [(s, loss) for s, loss in self._pending if through_step is None or s <= through_step]
        if not due:
            return None
        self._pending = self._pending[len(due) :]
        losses = np.asarray(jax.device_get([loss for _, loss in due]), np.float64)
        bad = np.flatnonzero(~np.isfinite(losses))
        if bad.size:
            self._stop(due[bad[0]][0], float(losses[bad[0]]))
        return self.stopped_step

    def _stop(self, step: int, value: float) -> None:
        self._pending.clear()
        self.stopped_step = step
        self.trainer.request_stop(nonfinite_step=step)
        warnings.warn(
            f"TerminateOnNaN: the loss is {value} at step {step}; training stopped at step "
            f"{self.trainer.step}. {self._in_memory(step)} Lower the learning rate or check "
            f"the data of step {step}.",
            RuntimeWarning,
            stacklevel=2,
        )

    def _in_memory(self, step: int) -> str:
        """What the weights left in memory are, and where to find good ones if they are not."""
        if self.trainer.plan.skip_nonfinite_updates:
            return (
                f"skip_nonfinite_updates: step {step}, and any other step whose loss or "
                "parameters were not finite, changed nothing, so the weights in memory are "
                f"those of the finite steps up to step {self.trainer.step}: evaluate or save them."
            )
        return (
            f"The weights in memory went through step {step}'s update and are not finite "
            f"(NaN, typically): restore a checkpoint from before step {step}, or train with "
            "Trainer(skip_nonfinite_updates=True), where such a step changes nothing."
        )

    @override
    def on_train_begin(self, logs: Logs) -> None:
        # A new fit (typically after restoring a good checkpoint) starts clean.
        self._pending.clear()
        self.stopped_step = None  # the trainer clears progress.nonfinite_step itself

    @override
    def on_train_batch_end(self, step: int, logs: Logs) -> None:
        if self.stopped_step is not None:
            return
        record = self.step_record
        assert record is not None and record.step == step
        self._pending.append((step, record.loss))
        if "train/loss" in logs:  # a log point: the devices were just synced for the metrics
            self.check()
        elif step % self.check_every_n_steps == 0:
            self.check(through_step=step - self.trainer.placement.max_steps_in_flight)

    @override
    def on_epoch_end(self, epoch: int, logs: Logs) -> None:
        self.check()

    @override
    def on_train_end(self, logs: Logs) -> None:
        self.check()
        self._pending.clear()
