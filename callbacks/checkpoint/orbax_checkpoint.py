"""OrbaxCheckpoint: sharded async checkpoints that resume exactly, on any layout.

The callback: its settings and the hooks that decide when to save and when to restore.
It holds its parts rather than inheriting them: ``tiers`` (``tiers.Tiers``: the
directories and their managers), ``writer`` (``writer.CheckpointWriter``) and
``resumer`` (``resumer.CheckpointResumer``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import orbax.checkpoint as ocp
from typing_extensions import override

from nnx_spmd_trainer import Callback, Logs, RunLock, deprecation
from nnx_spmd_trainer.adapters import orbax_private

from ..preemption import PreemptionNotice
from .reports import Reports
from .resumer import CheckpointResumer, Restore, Restored
from .save_errors import CheckpointWriteError
from .tiers import Tiers
from .timer import local_tier, save_timer
from .writer import CheckpointWriter

if TYPE_CHECKING:
    from nnx_spmd_trainer import Trainer


class OrbaxCheckpoint(Callback):
    """Saves the whole training run with Orbax, asynchronously, and resumes it exactly.

    One checkpoint is one Orbax step (``<directory>/<step>/``) holding:

    * ``state``: the model and optimizer state (RNG keys included) as sharded
      arrays, each process writing only its own shards;
    * ``train_metrics``: the on-device metric accumulators, so a resumed run logs the
      same averages at the same steps;
    * ``data``: a Grain iterator's position (``grain.checkpoint.CheckpointSave``),
      when ``train_data`` is a Grain dataset; other iterables are resumed by
      reading and discarding the batches already trained on (with a warning);
    * ``meta`` (JSON): the run state's host part (step, epoch, batches into the
      epoch, every callback's ``state_dict`` by ``state_key``, arrays left out),
      library versions, strategy, mesh, config;
    * ``callback_arrays_<n>``: the arrays of one callback's ``state_dict`` (an EMA
      of the weights, say), sharded like ``state``; ``meta["callback_arrays"]``
      names the callback of each. What a callback state may hold:
      ``Callback.state_dict``; anything else is refused, with the callback and key
      named, by the save that meets it, before anything is written;
    * ``fingerprints``: a fingerprint of every device array and whether the state
      and metrics are all finite, computed on the devices and written in the
      background, checked on restore.

    Saving blocks training only while the arrays are copied off the devices;
    the write goes on in the background and is waited for at the end of
    ``fit`` and on an exception. A step whose loss is not finite, or any step
    after ``trainer.progress.nonfinite_step``, is never saved, unless the trainer
    skips non-finite updates (``skip_nonfinite_updates=True``): then such a step
    changed nothing, and the state of the finite steps is saved.

    At the start of ``fit`` it restores ``restore``: ``"latest"`` (default),
    ``"best"`` (by ``monitor``), a step number, a step directory (of any
    run), or ``None``. Each leaf is read straight into this trainer's
    shardings, so a checkpoint written under one strategy or device count
    restores under another. A damaged, truncated or unfinished latest step is
    reported with its step and path and moved aside to ``<step>.damaged``
    (never deleted), and the newest good step is used; so is a step whose
    state turned out non-finite (``<step>.nonfinite``). Only the first ``fit``
    of this callback restores; restoring an older step than the latest moves
    the later ones aside (``<step>.after-<restored>``).

    To evaluate, generate or export from a checkpoint without training, restore
    it into any trainer of the same model and optimizer with
    ``OrbaxCheckpoint(directory).restore_into(trainer)`` (``restore=`` picks the
    step); it reads straight into the trainer's layout and sets ``trainer.step``.

    On SIGTERM (a preemption) it finishes the current step, saves, waits for
    the write, and stops training; ``fit`` runs ``on_train_end`` and returns
    with ``trainer.preempted`` set. A SIGTERM that comes before the first step
    (during the restore) stops ``fit`` before it trains, writing nothing. With
    several processes, all stop at the same check through JAX's preemption
    sync point (no Python handler then), so all save the same step or none.

    Two tiers: with ``local_directory``, steps are also saved there every
    ``local_every_n_steps`` (a fast disk, saved often; ``directory`` is the durable
    one, saved every ``save_every_n_steps`` or ``save_every_n_seconds``, on
    preemption and at the end). A step due in both goes to ``directory`` only.
    ``fit`` restores the newest step of either tier that reads and matches its
    fingerprints: a damaged or missing newest step of one tier falls back to the
    next newest of both, the persistent one first where both hold a step. With
    several processes the local directory, as ``directory``, must be one path every
    process reaches (per-host disks are what Orbax's emergency checkpointing is for;
    it needs data-parallel replicas across slices and saves the state alone, see
    docs/topics/checkpoints.md).

    Args:
      directory: where the steps go; created if missing.
      save_every_n_steps: save after every n-th step (and at the end of fit).
      save_every_n_seconds: also save when this many seconds have passed since the
        last save (or the start of ``fit``), by process 0's clock, every process
        saving the same step. The clock is read at the trainer's log points only
        (where every process already waits for the step), or every
        ``time_check_every_n_steps``; a save is late by at most one such interval.
      time_check_every_n_steps: where ``save_every_n_seconds`` is checked, in place
        of the log points. Each check with several processes makes the others wait
        for process 0 to reach it (one key-value read).
      local_directory: a second, fast directory for the frequent tier (see above).
      local_every_n_steps: save to ``local_directory`` after every n-th step.
      keep: how many of the latest steps to keep (older ones are removed).
      monitor: a ``logs`` key recorded with each step, for ``keep_best`` and
        ``restore="best"``.
      mode: ``"min"`` or ``"max"``: which ``monitor`` values are best.
      keep_best: also keep this many best steps by ``monitor``.
      async_save: write in the background (default) or block until written.
      restore: what to restore when ``fit`` starts (see above).
      print_fn: called with one line when a run is resumed (naming the tier and
        directory) or a step is set aside; e.g. ``print``. Without it, a step set aside
        is a ``RuntimeWarning``; each is reported once, by one or the other. ``report=``
        is its deprecated name.
      trainable_only: save all of the run but the model's frozen parameters (those the
        trainer's ``wrt`` leaves out: the base under LoRA), so a step holds the adapters,
        the optimizer state and the RNG state (small). A restore reads them over the
        trainer's first state, the base as ``init_from`` loads it again: give the
        resumed trainer the same ``init_from``. Resume is bitwise as with whole steps.

    It is built of three parts it holds: ``tiers`` (each directory and its Orbax
    manager), ``writer`` (a ``CheckpointWriter``: one step saved) and ``resumer`` (a
    ``CheckpointResumer``: which step, restored); what one step holds is ``format.py``'s.

    Example::

        checkpoint = OrbaxCheckpoint("runs/a/ckpt", save_every_n_steps=200, keep=3)
        trainer = Trainer(..., callbacks=[MetricsLogger(50), checkpoint])
        trainer.fit(data, max_steps=10_000)   # run again: continues where it stopped
    """

    goodput = "checkpoint"  # its hooks block training while arrays leave the devices

    report = deprecation.renamed_property(
        "OrbaxCheckpoint.report", "OrbaxCheckpoint.print_fn", lambda c: c.print_fn
    )

    @deprecation.renamed_keywords(report="print_fn")
    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        save_every_n_steps: int | None = None,
        save_every_n_seconds: float | None = None,
        time_check_every_n_steps: int | None = None,
        local_directory: str | os.PathLike[str] | None = None,
        local_every_n_steps: int | None = None,
        keep: int | None = 3,
        monitor: str | None = None,
        mode: Literal["min", "max"] = "min",
        keep_best: int | None = None,
        async_save: bool = True,
        restore: Restore = "latest",
        print_fn: Callable[[str], None] | None = None,
        trainable_only: bool = False,
    ) -> None:
        if save_every_n_steps is not None and save_every_n_steps < 1:
            raise ValueError(f"save_every_n_steps must be >= 1, got {save_every_n_steps}.")
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}.")
        if (keep_best is not None or restore == "best") and monitor is None:
            raise ValueError("keep_best and restore='best' need monitor='<a logs key>'.")
        self.directory = Path(directory).absolute()
        if self.directory.exists() and not self.directory.is_dir():
            raise NotADirectoryError(
                f"OrbaxCheckpoint directory {self.directory} is a file; give a directory."
            )
        self.save_every_n_steps = save_every_n_steps
        self.save_every_n_seconds = save_every_n_seconds
        self.time_check_every_n_steps = time_check_every_n_steps
        self.local_directory, self.local_every_n_steps = local_tier(
            self.directory, local_directory, local_every_n_steps
        )
        self._timer = save_timer(self.directory, save_every_n_seconds, time_check_every_n_steps)
        self.keep = keep
        self.monitor = monitor
        self.mode = mode
        self.keep_best = keep_best
        self.async_save = async_save
        self.restore = restore
        self.print_fn = print_fn
        self.state_key = f"OrbaxCheckpoint[{self.directory}]"
        reports = Reports(print_fn)
        #: Each tier's directory and Orbax manager.
        self.tiers = Tiers(
            self.directory, self.local_directory, keep=keep, monitor=monitor, mode=mode,
            keep_best=keep_best, async_save=async_save,
        )  # fmt: skip
        #: Saves one step into a tier.
        self.writer = CheckpointWriter(
            self.tiers, monitor=monitor, async_save=async_save, reports=reports,
            trainable_only=trainable_only,
        )  # fmt: skip
        #: Finds the step to restore and restores it (None with ``restore=None``).
        self.resumer = (
            CheckpointResumer(self.tiers, restore=restore, monitor=monitor, mode=mode,
                              reports=reports, trainable_only=trainable_only)
            if restore is not None else None
        )  # fmt: skip
        self._reports = reports
        #: The step restored by the first ``fit``, or ``None``.
        self.restored_step: int | None = None
        #: The layouts the restored arrays arrived in (this trainer's, read straight in).
        self.restored_layouts: list[Any] = []
        self._fitted = False
        self._restored_into: Trainer | None = None  # by restore_into, before any fit
        self._seen: dict[str, tuple[int, float]] = {}  # logs key -> (step, value)
        self._preemption = PreemptionNotice()
        #: A preemption notice stopped the last ``fit`` before its first step (nothing written).
        self.stopped_before_a_step = False
        # A failed restore leaves Orbax's reads to end on its closed event loop (noise).
        orbax_private.quiet_reads_after_a_failed_restore()

    # -- the tiers, the writer and the resumer, as methods of the callback --------------------
    @property
    def manager(self) -> ocp.CheckpointManager:
        """The Orbax manager of ``directory`` (the persistent tier)."""
        return self.tiers.persistent

    @property
    def local_manager(self) -> ocp.CheckpointManager | None:
        """The manager of ``local_directory`` (None without a local tier)."""
        return self.tiers.local

    def steps(self) -> list[int]:
        """The committed steps in ``directory``, oldest first."""
        return self.tiers.steps_of(self.tiers.persistent)

    def local_steps(self) -> list[int]:
        """The committed steps in ``local_directory``, oldest first ([] without one)."""
        local = self.tiers.local
        return [] if local is None else self.tiers.steps_of(local)

    def save(self, step: int, *, force: bool = False, local: bool = False) -> bool:
        """Saves the run as it is now under ``step``; False if it is not saved (NaN, or saved).

        ``local``: to ``local_directory`` (the frequent tier) instead of ``directory``.
        A step that cannot be written, now or by the background write of an earlier
        save, raises ``CheckpointWriteError`` naming that step and its directory."""
        monitored = self._seen.get(self.monitor) if self.monitor else None
        saved = self.writer.save(self.trainer, step, local=local, force=force, monitored=monitored)
        if saved and not local and self._timer is not None:
            self._timer.restart()  # the seconds count from this save
        return saved

    def restore_into(self, trainer: Trainer) -> int | None:
        """Restores a checkpoint into ``trainer`` without training: to ``evaluate``,
        generate or export from it, before (or instead of) any ``fit``.

        Restores the ``restore`` choice (``"latest"`` by default, ``"best"``, a step
        number or a step directory) straight into ``trainer.run_state(abstract=True)``:
        each array is read into the trainer's own layout (any strategy, any device
        count) and no initial state is ever built. ``trainer.step``, the train metrics,
        the callback states of the trainer's callbacks and the data position are
        restored, and ``restored_step`` is set. The trainer need not hold this callback;
        if it does, its next ``fit`` goes on from the restored step without restoring
        again. The directory is only read: a damaged step is skipped (reported as
        ``print_fn`` says, not moved aside) and the step before it restored; a step
        asked for by number that is damaged raises ``DamagedCheckpoint``.

        Returns the step restored, or ``None`` when the directory holds no step.

        Example::

            trainer = Trainer(make_model, optax.adamw(1e-3), strategy=FSDP(), loss_fn=loss)
            step = OrbaxCheckpoint("runs/a/ckpt").restore_into(trainer)  # or restore=2000
            print(step, trainer.evaluate(eval_data))
        """
        bound = getattr(self, "trainer", None)
        if bound is not None and bound is not trainer:
            raise ValueError(
                "this OrbaxCheckpoint is a callback of another trainer; restore into "
                "that one, or make a new OrbaxCheckpoint(directory) for this trainer."
            )
        if self.resumer is None:
            raise ValueError("restore_into needs a step to restore; this has restore=None.")
        restored = self._restored(self.resumer.into(trainer))
        self._restored_into = trainer if restored is not None else None
        if restored is not None:
            self._reports.news(
                f"restored checkpoint step {restored.step} from "
                f"{self.tiers.where(restored.directory)}"
            )
        return self.restored_step

    def restore_into_trainer(self) -> int | None:
        """What ``fit`` restores at its start: the ``restore`` choice into this callback's
        trainer, moving damaged steps aside. Prefer ``restore_into(trainer)``."""
        if self.resumer is None:
            return None
        restored = self._restored(self.resumer.into_fit(self.trainer))
        return None if restored is None else restored.step

    def _restored(self, restored: Restored | None) -> Restored | None:
        self.restored_step = None if restored is None else restored.step
        if restored is not None:
            self.restored_layouts = restored.layouts
        return restored

    @override
    def layout_to_resume(self) -> str | None:
        """The strategy the step the next ``fit`` restores was saved under, read from its
        metadata alone (nothing written); ``None`` when no step would be restored or its
        metadata cannot be read (the restore then deals with it)."""
        if self.resumer is None or self._fitted:
            return None
        return self.resumer.layout_to_resume()

    def check_model(self) -> None:
        """Raises ``CheckpointOfAnotherModel`` (naming the leaves and the fix) if the step
        the next ``fit`` would restore was written for another model or optimizer than
        this callback's trainer holds. Reads that step's metadata alone and writes
        nothing, so a run can be refused before it writes anything (the CLI does); the
        restore in ``fit`` checks again. A step that cannot be read is the restore's to
        report: it passes here."""
        if self.resumer is not None and not self._fitted:
            self.resumer.check_model(self.trainer)

    def resumes(self) -> bool:
        """Whether the next ``fit`` would restore a step (read-only: nothing is created)."""
        if self.resumer is None or self._fitted:
            return False
        with self.resumer.step_to_resume() as (_, step):
            return step is not None

    def _note(self, logs: Logs) -> None:
        for key, value in logs.items():
            self._seen[key] = (self.trainer.step, value)

    # -- hooks ------------------------------------------------------------------------------
    @override
    def on_fit_start(self, logs: Logs) -> None:
        # First: a SIGTERM during the restore (or anything below) is then a notice, not death.
        self._preemption.listen()
        self.stopped_before_a_step = False
        self._seen = {}
        refused = self._timer and self._timer.check_refused(self.trainer.log_schedule)
        if refused:
            raise ValueError(refused)
        self.tiers.lock()
        if self.resumer is not None and not self._fitted:
            if self._restored_into is self.trainer:
                # restore_into(trainer) already restored: fit goes on from there.
                assert self.restored_step is not None
            else:
                # Only the first fit resumes: a later fit of this trainer goes on from where
                # the previous one left its state, as it would without checkpoints.
                restored = self._restored(self.resumer.into_fit(self.trainer))
                if restored is not None:
                    self._reports.news(
                        f"resuming from checkpoint step {restored.step} in "
                        f"{self.tiers.where(restored.directory)}"
                    )
            if self.restored_step is not None:
                self.resumer.set_aside_later_than(self.restored_step)
        self._fitted = True
        self.tiers.check_not_ahead_of(self.trainer.step)
        if self._timer is not None:
            self._timer.restart()  # the seconds count from the start of training
        if self._preemption.reached():  # a notice during the restore: no step, nothing saved
            self._stop_before_a_step()

    @override
    def on_train_batch_end(self, step: int, logs: Logs) -> None:
        self._note(logs)

    @override
    def on_test_end(self, logs: Logs) -> None:
        self._note(logs)

    @override
    def on_step_end(self, step: int) -> None:
        # Everything about this step (its logs, its evaluation) is in the callbacks' states.
        if self._preemption.reached():
            self._save_for_preemption(step)
        elif (self.save_every_n_steps and step % self.save_every_n_steps == 0) or (
            # Asked after the same steps on every process (the ones above are agreed too).
            self._timer is not None and self._timer.due(step, self.trainer.log_schedule)
        ):
            self.save(step)
        elif self.local_every_n_steps and step % self.local_every_n_steps == 0:
            self.save(step, local=True)

    def _save_for_preemption(self, step: int) -> None:
        self.save(step, force=True)
        self.writer.finish()
        self.trainer.request_stop(preempted=True)
        self._reports.news(f"preempted: saved step {step} in {self.directory}; run again to resume")

    def _stop_before_a_step(self) -> None:
        self.stopped_before_a_step = True
        self.trainer.request_stop(preempted=True)
        latest = self.manager.latest_step()
        kept = f"step {latest} is the latest" if latest is not None else "none saved yet"
        self._reports.news(
            f"preempted before any step: the checkpoints in {self.directory} are as they "
            f"were ({kept}); run again to resume"
        )

    @override
    def on_train_end(self, logs: Logs) -> None:
        self._note(logs)

    @override
    def on_fit_end(self, logs: Logs) -> None:
        try:
            if not self.stopped_before_a_step:  # else nothing trained: nothing to write
                self.save(self.trainer.step)  # the final state (a no-op if just saved)
            self.writer.finish()
            self.writer.check_last_saved()
        finally:
            self._preemption.stop()
            self.tiers.release()

    @override
    def on_exception(self, error: BaseException) -> None:
        self._preemption.stop()
        try:
            self.writer.finish()  # a save in flight completes; nothing half-done
        except CheckpointWriteError:
            # Already reported, or the save Ctrl-C interrupted: the committed steps stay.
            if isinstance(error, Exception) and not isinstance(error, CheckpointWriteError):
                raise
        finally:
            self.tiers.release()

    @property
    def _lock(self) -> RunLock:
        """The persistent tier's lock (tests/test_run_lock.py reads it)."""
        return self.tiers.locks[0]
