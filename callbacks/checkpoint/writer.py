"""CheckpointWriter: one step saved into one tier, the part of ``OrbaxCheckpoint`` that writes.

What a step holds is ``format.py``'s; here: when a step may not be saved (a non-finite
one, one already there), the write itself (blocking only while the arrays leave the
devices), waiting for the write in flight, and a saved state that turned out non-finite
moved aside as soon as that is known. ``OrbaxCheckpoint``'s hooks decide when to save.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from . import format
from .fingerprint import PendingSummary, summarize
from .reports import Reports
from .save_errors import check_writable, writing
from .tiers import Tiers

if TYPE_CHECKING:
    from nnx_spmd_trainer import Trainer


class CheckpointWriter:
    """Saves a trainer's run into a tier of ``tiers``, one step at a time.

    Args:
      tiers: the directories and their managers.
      monitor: the ``logs`` key recorded with each step (``keep_best``, "best"), or None.
      async_save: return once the arrays are off the devices (True) or once written.
      reports: where a step set aside is reported.
      trainable_only: save all but the model's frozen parameters (``format.kept_state``).
    """

    def __init__(
        self,
        tiers: Tiers,
        *,
        monitor: str | None,
        async_save: bool,
        reports: Reports,
        trainable_only: bool = False,
    ) -> None:
        self.tiers = tiers
        self.trainable_only = trainable_only
        self.monitor = monitor
        self.async_save = async_save
        self.reports = reports
        # The (tier's manager, step, finite flag) of the last save, checked at the next.
        self._last_saved: tuple[ocp.CheckpointManager, int, jax.Array] | None = None
        # The (directory, step) whose write may still be going on.
        self._writing: tuple[Path, int] | None = None

    def savable(self, trainer: Trainer, step: int, manager: ocp.CheckpointManager) -> bool:
        """Whether ``step`` may be saved into ``manager``'s tier now."""
        if step in manager.all_steps():
            return False
        if trainer.plan.skip_nonfinite_updates:
            # A non-finite step changed nothing: the state is the finite steps' (and the
            # saved state's own finiteness check still runs, check_last_saved).
            return True
        if trainer.progress.nonfinite_step is not None:
            return False
        record = trainer.last_step  # the step saved: saving waits for it anyway
        return record is None or math.isfinite(record.loss_value())

    def save(
        self,
        trainer: Trainer,
        step: int,
        *,
        local: bool = False,
        force: bool = False,
        monitored: tuple[int, float] | None = None,
    ) -> bool:
        """Saves ``trainer``'s run under ``step``; False if it is not saved (NaN, or saved).

        ``local``: into the local tier. ``monitored``: the (step, value) of ``monitor``
        last logged. A step that cannot be written, now or by the background write of an
        earlier save, raises ``CheckpointWriteError`` naming that step and its directory."""
        directory = self.tiers.local_directory if local else self.tiers.directory
        manager = self.tiers.local if local else self.tiers.persistent
        if directory is None or manager is None:
            raise ValueError("save(local=True) needs OrbaxCheckpoint(local_directory=...).")
        self.finish()
        self.check_last_saved()
        if not self.savable(trainer, step, manager):
            return False
        check_writable(directory, step)
        run = trainer.run_state()
        if self.trainable_only:  # the frozen base stays out: the first state has it
            run = dataclasses.replace(run, state=format.kept_state(run.state, trainer.plan.wrt))
        monitor = {self.monitor: monitored} if self.monitor else {}
        # A callback state that cannot be stored raises here (TypeError naming the callback
        # and key), before Orbax is called: nothing is left half-written.
        per_callback = format.callback_items(run)
        meta = format.describe(
            trainer, step, run, monitor, per_callback, trainable_only=self.trainable_only
        )
        leaves = {name: arrays for name, (_, arrays) in per_callback.items()}
        pending = PendingSummary()
        args = format.save_args(run, meta, leaves, pending)
        metric = monitored[1] if monitored is not None and monitored[0] == step else None
        # Each leaf named as its item and path, as the reader checks it (step_reader.py).
        fingerprinted: dict[str, Any] = {
            format.STATE: run.state,
            format.TRAIN_METRICS: run.train_metrics,
            **{name: format.on_devices(arrays) for name, arrays in leaves.items()},
        }

        def summarize_state() -> None:
            # Callback arrays are fingerprinted, but only the run's own state must be finite
            # (its train metrics may average a NaN step skip_nonfinite_updates skipped).
            summary = summarize(fingerprinted, finite=run.state)
            pending.set(summary)
            self._last_saved = (manager, step, summary["finite"])

        self._writing = (directory, step)
        try:
            if not self.async_save:  # save returns once written: the summary must be there
                summarize_state()
            with writing(directory, step):
                saved = manager.save(
                    step,
                    args=args,
                    metrics={self.monitor: metric} if metric is not None else None,
                    force=force,
                )
            if self.async_save:
                # Dispatched after Orbax's copy to the host, so the devices compute the
                # fingerprints while the write goes on; the write waits for them, not training.
                summarize_state()
        finally:
            # Interrupted before that (Ctrl-C): the background write fails now instead of
            # waiting for the fingerprints, which would keep the process alive.
            pending.cancel()
        return bool(saved)

    def finish(self) -> None:
        """Waits for the save in flight; its failure raises ``CheckpointWriteError``."""
        directory, step = self._writing or (self.tiers.directory, None)
        with writing(directory, step):
            for manager in self.tiers.opened():
                manager.wait_until_finished()
        self._writing = None

    def check_last_saved(self) -> None:
        """A saved state that turned out non-finite (a finite loss, NaN gradients) is
        moved aside as soon as that is known, so it never stays the latest step."""
        if self._last_saved is None:
            return
        manager, step, finite = self._last_saved
        self._last_saved = None
        if not bool(np.asarray(finite.addressable_data(0))):
            self.finish()
            aside = self.tiers.set_aside(manager, step, "nonfinite")
            self.reports.trouble(
                f"checkpoint step {step} holds non-finite values; moved to {aside}."
            )
