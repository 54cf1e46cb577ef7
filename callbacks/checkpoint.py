"""OrbaxCheckpoint: sharded async checkpoints that resume exactly, on any layout."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies
from typing_extensions import override

from nnx_spmd_trainer import Callback, Logs, RunState, as_position, deprecation
from nnx_spmd_trainer.run_lock import RunLock

from .checkpoint_checks import DamagedCheckpoint, agree_on_damage, check_same_model
from .checkpoint_items import callback_items, jsonable, on_devices, versions
from .checkpoint_restore import read_meta, read_step, set_aside
from .checkpoint_save import CheckpointWriteError, check_writable, writing
from .fingerprint import FingerprintSave, PendingSummary, summarize
from .preemption import PreemptionNotice, QuietManager

if TYPE_CHECKING:
    from nnx_spmd_trainer.trainer import Trainer

Restore = Literal["latest", "best"] | int | str | os.PathLike[str] | None


class _ReadOnlyNotes(logging.Filter):
    """Orbax warns whenever a read-only manager opens, as restores and layout reads here
    do on purpose: those two lines tell the user nothing."""

    NOTES = ("CheckpointManagerOptions.read_only=True", "Given directory is read only")

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.NOTES)


logging.getLogger("absl").addFilter(_ReadOnlyNotes())


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
    after ``trainer.progress.nonfinite_step``, is never saved.

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

    Args:
      directory: where the steps go; created if missing.
      save_every_n_steps: save after every n-th step (and at the end of fit).
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
        self._last_saved: tuple[int, jax.Array] | None = None
        self._writing: int | None = None  # the step whose write may still be going on
        self._manager: ocp.CheckpointManager | None = None
        self._seen: dict[str, tuple[int, float]] = {}  # logs key -> (step, value)
        self._preemption = PreemptionNotice()
        #: A preemption notice stopped the last ``fit`` before its first step (nothing written).
        self.stopped_before_a_step = False
        self._lock = RunLock(self.directory)  # one run writes the directory at a time

    # -- the manager -------------------------------------------------------------------
    @property
    def manager(self) -> ocp.CheckpointManager:
        if self._manager is None:
            self._manager = self._make_manager(self.directory)
        return self._manager

    def _make_manager(self, directory: Path, *, read_only: bool = False) -> ocp.CheckpointManager:
        preserve: list[policies.PreservationPolicy] = [policies.LatestN(n=self.keep)]
        if self.keep_best is not None and self.monitor is not None:
            monitor = self.monitor
            preserve.append(
                policies.BestN(
                    get_metric_fn=lambda metrics: metrics[monitor],
                    reverse=self.mode == "min",
                    n=self.keep_best,
                    keep_checkpoints_without_metrics=False,
                )
            )
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=self.async_save,
            preservation_policy=policies.AnyPreservationPolicy(preserve),
            # With a best_fn Orbax also writes each step's metrics, read back by "best".
            best_fn=(lambda metrics: metrics[self.monitor]) if self.monitor else None,
            best_mode=self.mode,
            create=not read_only,
            read_only=read_only,
        )
        return QuietManager(directory, options=options)  # leaves JAX's preemption count alone

    def steps(self) -> list[int]:
        """The committed steps in ``directory``, oldest first."""
        return sorted(self.manager.all_steps())

    # -- saving --------------------------------------------------------------------------
    def _savable(self, step: int) -> bool:
        trainer = self.trainer
        if trainer.progress.nonfinite_step is not None or step in self.manager.all_steps():
            return False
        loss = trainer.metric_log.last_loss
        return loss is None or math.isfinite(float(np.asarray(jax.device_get(loss))))

    def save(self, step: int, *, force: bool = False) -> bool:
        """Saves the run as it is now under ``step``; False if it is not saved (NaN, or saved).

        A step that cannot be written, now or by the background write of an earlier
        save, raises ``CheckpointWriteError`` naming that step and ``directory``."""
        self._finish_writing()
        self._check_last_saved()
        if not self._savable(step):
            return False
        check_writable(self.directory, step)
        run = self.trainer.run_state()
        # A callback state that cannot be stored raises here (TypeError naming the callback
        # and key), before Orbax is called: nothing is left half-written.
        meta = self._meta(step, run)
        per_callback = callback_items(run)
        meta["callback_arrays"] = {key: name for name, (key, _) in per_callback.items()}
        items: dict[str, Any] = {
            "state": ocp.args.StandardSave(run.state),
            "train_metrics": ocp.args.StandardSave(run.train_metrics),
            "meta": ocp.args.JsonSave(meta),
        }
        for name, (_, leaves) in per_callback.items():
            items[name] = ocp.args.StandardSave(leaves)
        if run.data is not None:  # where the next step's batch starts, even read ahead
            items["data"] = grain.checkpoint.CheckpointSave(as_position(run.data))
        pending = PendingSummary()
        items["fingerprints"] = FingerprintSave(pending)
        logged = self._seen.get(self.monitor) if self.monitor else None
        metric = logged[1] if logged is not None and logged[0] == step else None
        fingerprinted = {
            **run.arrays(),
            **{name: on_devices(leaves) for name, (_, leaves) in per_callback.items()},
        }

        def summarize_state() -> None:
            # Callback arrays are fingerprinted, but only the run's own state must be finite.
            summary = summarize(fingerprinted, finite=run.arrays())
            pending.set(summary)
            self._last_saved = (step, summary["finite"])

        self._writing = step
        try:
            if not self.async_save:  # save returns once written: the summary must be there
                summarize_state()
            with writing(self.directory, step):
                saved = self.manager.save(
                    step,
                    args=ocp.args.Composite(**items),
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

    def _finish_writing(self) -> None:
        """Waits for the save in flight; its failure raises ``CheckpointWriteError``."""
        if self._manager is not None:
            with writing(self.directory, self._writing):
                self._manager.wait_until_finished()
        self._writing = None

    def _check_last_saved(self) -> None:
        """A saved state that turned out non-finite (a finite loss, NaN gradients) is
        moved aside as soon as that is known, so it never stays the latest step."""
        if self._last_saved is None:
            return
        step, finite = self._last_saved
        self._last_saved = None
        if not bool(np.asarray(finite.addressable_data(0))):
            self._finish_writing()
            set_aside(
                self.manager, step, f"checkpoint step {step} holds non-finite values",
                label="nonfinite", print_fn=self.print_fn,
            )  # fmt: skip

    def _meta(self, step: int, run: RunState) -> dict[str, Any]:
        trainer = self.trainer
        host = run.host()
        return {
            **host,
            "step": step,
            "data": "grain" if run.data is not None else "skip",
            # Grain keeps no checksum of its file: the position is checked against this.
            "data_position": host.get("data"),
            "monitor": {self.monitor: self._seen.get(self.monitor)} if self.monitor else {},
            "versions": versions(),
            "strategy": repr(trainer.strategy),
            "mesh": dict(trainer.mesh.shape),
            "num_processes": jax.process_count(),
            "config": jsonable(trainer.config),
            "time": time.time(),
        }

    # -- restoring -------------------------------------------------------------------------
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
        again. The directory is only read: a damaged step is skipped with a warning
        (not moved aside) and the step before it restored; a step asked for by number
        that is damaged raises ``DamagedCheckpoint``.

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
        if self.restore is None:
            raise ValueError("restore_into needs a step to restore; this has restore=None.")
        by_path = self.restore not in ("latest", "best") and not isinstance(self.restore, int)
        manager = None  # a step directory is read through a manager of its own
        if not by_path:
            if not self.directory.is_dir():
                self.restored_step = None
                return None
            manager = self._make_manager(self.directory, read_only=True)
        try:
            step = self._restore(trainer, manager, move_damaged=False)
        finally:
            if manager is not None:  # everything is read, the data position too
                manager.close()
        self.restored_step = step
        self._restored_into = trainer if step is not None else None
        if step is not None and self.print_fn is not None:
            self.print_fn(f"restored checkpoint step {step} from {self.directory}")
        return step

    @override
    def layout_to_resume(self) -> str | None:
        """The strategy the step the next ``fit`` restores was saved under, read from its
        metadata alone (nothing written); ``None`` when no step would be restored or its
        metadata cannot be read (the restore then deals with it)."""
        with self._step_to_resume() as (manager, step):
            if manager is None or step is None:
                return None
            try:
                return str(read_meta(manager, step)["strategy"])
            except Exception:  # Orbax raises many kinds; a damaged step is the restore's
                return None

    def check_model(self) -> None:
        """Raises ``CheckpointOfAnotherModel`` (naming the leaves and the fix) if the step
        the next ``fit`` would restore was written for another model or optimizer than
        this callback's trainer holds. Reads that step's metadata alone and writes
        nothing, so a run can be refused before it writes anything (the CLI does); the
        restore in ``fit`` checks again. A step that cannot be read is the restore's to
        report: it passes here."""
        with self._step_to_resume() as (manager, step):
            if manager is not None and step is not None:
                state = self.trainer.run_state(abstract=True).state
                check_same_model(Path(manager.directory) / str(step), step, state)

    @contextlib.contextmanager
    def _step_to_resume(self) -> Iterator[tuple[ocp.CheckpointManager | None, int | None]]:
        """(a read-only manager, the step the next ``fit`` would restore first), closed
        after; ``(None, None)`` when no step would be restored or none can be listed."""
        by_path = self.restore not in ("latest", "best") and not isinstance(self.restore, int)
        if self.restore is None or self._fitted or (not by_path and not self.directory.is_dir()):
            yield None, None
            return
        opened: list[ocp.CheckpointManager] = []
        try:
            try:
                if not by_path:
                    opened.append(self._make_manager(self.directory, read_only=True))
                manager, steps, _ = self._candidates(opened[0] if opened else None)
                opened.append(manager)  # a step directory's own manager, closed too
            except Exception:  # Orbax raises many kinds; the restore names what is wrong
                manager, steps = None, []
            yield manager, (steps[0] if steps else None)
        finally:
            for manager in dict.fromkeys(opened):  # each once
                manager.close()

    def restore_into_trainer(self) -> int | None:
        """What ``fit`` restores at its start: the ``restore`` choice into this callback's
        trainer, moving damaged steps aside. Prefer ``restore_into(trainer)``."""
        return self._restore(self.trainer, self.manager, move_damaged=True)

    def _candidates(
        self, manager: ocp.CheckpointManager | None
    ) -> tuple[ocp.CheckpointManager, list[int], bool]:
        """(manager, steps to try newest first, whether falling back is allowed); the
        ``manager`` of ``directory`` is needed unless ``restore`` is a step directory."""
        restore = self.restore
        assert restore is not None  # nothing is restored then
        if restore in ("latest", "best") or isinstance(restore, int):
            assert manager is not None
            if restore == "latest":
                return manager, sorted(manager.all_steps(), reverse=True), True
            if restore == "best":
                return manager, self._by_monitor(manager), True
            return manager, [int(restore)], False
        path = Path(os.fspath(restore)).absolute()  # a step directory, of any run
        if not path.name.isdigit():
            raise ValueError(f"restore={str(restore)!r} is not a step directory (…/<step>).")
        other = ocp.CheckpointManager(
            path.parent, options=ocp.CheckpointManagerOptions(read_only=True, create=False)
        )
        return other, [int(path.name)], False

    def _by_monitor(self, manager: ocp.CheckpointManager) -> list[int]:
        scored = []
        for step in sorted(manager.all_steps()):
            value = (manager.metrics(step) or {}).get(self.monitor)
            if value is not None:
                scored.append((value if self.mode == "min" else -value, step))
        return [step for _, step in sorted(scored)]

    def _restore(
        self, trainer: Trainer, manager: ocp.CheckpointManager | None, *, move_damaged: bool
    ) -> int | None:
        """Restores the ``restore`` choice into ``trainer``; the step restored, or None."""
        manager, candidates, fall_back = self._candidates(manager)
        for step in candidates:
            damaged: DamagedCheckpoint | None = None
            try:
                saved = read_step(trainer, manager, step)
            except DamagedCheckpoint as error:
                damaged = error
            # Every process must take the same branch: one that read damage makes all skip.
            damaged = agree_on_damage(damaged, step, manager.directory)
            if damaged is None:
                self._apply(trainer, saved)
                return step
            if not fall_back:
                raise damaged
            if move_damaged:
                set_aside(manager, step, damaged, print_fn=self.print_fn)
            else:
                message = f"{damaged}; restoring an earlier step (left where it is)."
                warnings.warn(message, RuntimeWarning, stacklevel=3)
                if self.print_fn is not None:
                    self.print_fn(message)
        return None

    def _apply(self, trainer: Trainer, saved: dict[str, Any]) -> None:
        meta = saved["meta"]
        self.restored_layouts = [leaf.sharding for leaf in jax.tree.leaves(saved["state"])]
        arrays = {"state": saved["state"], "train_metrics": saved["train_metrics"]}
        callback_arrays = {
            key: saved[name]
            for key, name in meta.get("callback_arrays", {}).items()
            if name in saved
        }
        trainer.load_run_state(
            RunState.from_saved(arrays, meta, callback_arrays=callback_arrays, data=saved["data"])
        )

    def _set_aside_later_than(self, step: int) -> None:
        """After restoring an older step (best, or by number), the later steps are moved
        aside so new saves from here are not refused; nothing is deleted."""
        for later in [s for s in self.steps() if s > step]:
            set_aside(
                self.manager, later, f"step {later} is later than restored step {step}",
                label=f"after-{step}", warn=False, print_fn=self.print_fn,
            )  # fmt: skip

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
        if jax.process_index() == 0:  # one holder per job: the others write only shards
            self._lock.acquire()  # DirectoryInUse naming the other run's process
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
        latest = self.manager.latest_step()
        if latest is not None and latest > self.trainer.step:
            raise ValueError(
                f"{self.directory} already holds checkpoints up to step {latest}, ahead of "
                f"this run's step {self.trainer.step}, and new steps there would be refused. "
                "Resume them (restore='latest') or save this run in another directory."
            )
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
        elif self.save_every_n_steps and step % self.save_every_n_steps == 0:
            self.save(step)

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
            self._lock.release()

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
            self._lock.release()
