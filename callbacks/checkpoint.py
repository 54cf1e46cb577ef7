"""OrbaxCheckpoint: sharded async checkpoints that resume exactly, on any layout.

This module holds its settings and the hooks that decide when to save; saving (and each
tier's manager) is its base class ``checkpoint_writer.CheckpointWriter``, restoring that
one's base, ``checkpoint_resume.CheckpointResume``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import jax
import orbax.checkpoint as ocp
from typing_extensions import override

from nnx_spmd_trainer import Logs, RunLock, deprecation
from nnx_spmd_trainer.adapters import orbax_private

from .checkpoint_resume import Restore
from .checkpoint_save import CheckpointWriteError
from .checkpoint_timer import local_tier, save_timer
from .checkpoint_writer import CheckpointWriter
from .preemption import PreemptionNotice

if TYPE_CHECKING:
    from nnx_spmd_trainer import Trainer


class OrbaxCheckpoint(CheckpointWriter):
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
      print_fn: called with one line when a run is resumed or a step is skipped
        as damaged (damage is also a warning); e.g. ``print``. ``report=`` is its
        deprecated name.

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
        #: The step restored by the first ``fit``, or ``None``.
        self.restored_step: int | None = None
        #: The layouts the restored arrays arrived in (this trainer's, read straight in).
        self.restored_layouts: list[Any] = []
        self._fitted = False
        self._restored_into: Trainer | None = None  # by restore_into, before any fit
        # The (tier's manager, step, finite flag) of the last save, checked at the next.
        self._last_saved: tuple[ocp.CheckpointManager, int, jax.Array] | None = None
        # The (directory, step) whose write may still be going on.
        self._writing: tuple[Path, int] | None = None
        self._manager: ocp.CheckpointManager | None = None
        self._local_manager: ocp.CheckpointManager | None = None
        self._seen: dict[str, tuple[int, float]] = {}  # logs key -> (step, value)
        self._preemption = PreemptionNotice()
        #: A preemption notice stopped the last ``fit`` before its first step (nothing written).
        self.stopped_before_a_step = False
        # A failed restore leaves Orbax's reads to end on its closed event loop (noise).
        orbax_private.quiet_reads_after_a_failed_restore()
        self._lock = RunLock(self.directory)  # one run writes the directory at a time
        self._local_lock = RunLock(self.local_directory) if self.local_directory else None

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
        if jax.process_index() == 0:  # one holder per job: the others write only shards
            for lock in (self._lock, self._local_lock):
                if lock is not None:
                    _take(lock)
        if self._restored_into is self.trainer and not self._fitted:
            # restore_into(trainer) already restored: fit goes on from there.
            assert self.restored_step is not None
            self._set_aside_later_than(self.restored_step)
        elif self.restore is not None and not self._fitted:
            # Only the first fit resumes: a later fit of this trainer goes on from where
            # the previous one left its state, as it would without checkpoints.
            self.restored_step = self.restore_into_trainer()
            if self.restored_step is not None and self.print_fn is not None:
                self.print_fn(
                    f"resuming from checkpoint step {self.restored_step} in {self.directory}"
                )
            if self.restored_step is not None:
                self._set_aside_later_than(self.restored_step)
        self._fitted = True
        for manager in self._managers():
            latest = manager.latest_step()
            if latest is not None and latest > self.trainer.step:
                raise ValueError(
                    f"{manager.directory} already holds checkpoints up to step {latest}, ahead "
                    f"of this run's step {self.trainer.step}, and new steps there would be "
                    "refused. Resume them (restore='latest') or save this run in another "
                    "directory."
                )
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
        self._finish_writing()
        self.trainer.request_stop(preempted=True)
        if self.print_fn is not None:
            self.print_fn(f"preempted: saved step {step} in {self.directory}; run again to resume")

    def _stop_before_a_step(self) -> None:
        self.stopped_before_a_step = True
        self.trainer.request_stop(preempted=True)
        if self.print_fn is not None:
            latest = self.manager.latest_step()
            kept = f"step {latest} is the latest" if latest is not None else "none saved yet"
            self.print_fn(
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
            self._finish_writing()
            self._check_last_saved()
        finally:
            self._preemption.stop()
            self._release_locks()

    @override
    def on_exception(self, error: BaseException) -> None:
        self._preemption.stop()
        try:
            self._finish_writing()  # a save in flight completes; nothing half-done
        except CheckpointWriteError:
            # Already reported, or the save Ctrl-C interrupted: the committed steps stay.
            if isinstance(error, Exception) and not isinstance(error, CheckpointWriteError):
                raise
        finally:
            self._release_locks()

    def _release_locks(self) -> None:
        self._lock.release()
        if self._local_lock is not None:
            self._local_lock.release()


def _take(lock: RunLock) -> None:
    """``lock.acquire()``: ``DirectoryInUse`` naming the other run's process, or a
    directory this process cannot write as a ``CheckpointWriteError`` (an ``OSError``),
    raised before the first step, with nothing trained."""
    try:
        lock.acquire()
    except OSError as error:
        raise CheckpointWriteError(
            f"OrbaxCheckpoint cannot write {lock.directory} ({error.strerror}), so no "
            "checkpoint could be saved; nothing was trained. Give a directory this process "
            "can write, or fix its permissions (a read-only or full file system)."
        ) from error
