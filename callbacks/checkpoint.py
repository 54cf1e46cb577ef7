"""OrbaxCheckpoint: sharded async checkpoints that resume exactly, on any layout."""

from __future__ import annotations

import functools
import importlib.metadata
import json
import math
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from orbax.checkpoint import checkpoint_managers as policies
from typing_extensions import override

from nnx_spmd_trainer import Callback, Logs, RunState
from nnx_spmd_trainer.prefetch import as_position, has_position

from .checkpoint_checks import (
    DamagedCheckpoint,
    agree_on_damage,
    check_same_model,
)
from .fingerprint import (
    FingerprintRestore,
    FingerprintSave,
    PendingSummary,
    mismatches,
    summarize,
)
from .preemption import PreemptionNotice

Restore = Literal["latest", "best"] | int | str | os.PathLike[str] | None


@functools.cache
def _versions() -> dict[str, str]:
    names = ("nnx-spmd-trainer", "jax", "flax", "optax", "orbax-checkpoint", "grain")
    found = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def _jsonable(config: Any) -> Any:
    if config is None:
        return None
    if hasattr(config, "to_json_best_effort"):  # ml_collections.ConfigDict
        return json.loads(config.to_json_best_effort())
    return json.loads(json.dumps(config, default=repr))


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
      epoch, every callback's ``state_dict`` by ``state_key``), library
      versions, strategy, mesh, config;
    * ``fingerprints``: a fingerprint of every leaf and whether all are finite,
      computed on the devices and written in the background, checked on restore.

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

    On SIGTERM (a preemption) it finishes the current step, saves, waits for
    the write, and stops training; ``fit`` runs ``on_train_end`` and returns
    with ``trainer.preempted`` set. With several processes, all stop at the
    same step through JAX's preemption sync point (no Python handler then).

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
      report: called with one line when a run is resumed or a step is skipped
        as damaged (damage is also a warning); e.g. ``print``.

    Example::

        checkpoint = OrbaxCheckpoint("runs/a/ckpt", save_every_n_steps=200, keep=3)
        trainer = Trainer(..., callbacks=[MetricsLogger(50), checkpoint])
        trainer.fit(data, max_steps=10_000)   # run again: continues where it stopped
    """

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
        report: Callable[[str], None] | None = None,
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
        self.report = report
        self.state_key = f"OrbaxCheckpoint[{self.directory}]"
        #: The step restored by the first ``fit``, or ``None``.
        self.restored_step: int | None = None
        #: The layouts the restored arrays arrived in (this trainer's, read straight in).
        self.restored_layouts: list[Any] = []
        self._fitted = False
        self._last_saved: tuple[int, jax.Array] | None = None
        self._manager: ocp.CheckpointManager | None = None
        self._seen: dict[str, tuple[int, float]] = {}  # logs key -> (step, value)
        self._preemption = PreemptionNotice()

    # -- the manager -------------------------------------------------------------------
    @property
    def manager(self) -> ocp.CheckpointManager:
        if self._manager is None:
            self._manager = self._make_manager(self.directory)
        return self._manager

    def _make_manager(self, directory: Path) -> ocp.CheckpointManager:
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
            create=True,
        )
        return ocp.CheckpointManager(directory, options=options)

    def steps(self) -> list[int]:
        """The committed steps in ``directory``, oldest first."""
        return sorted(self.manager.all_steps())

    # -- saving --------------------------------------------------------------------------
    def _savable(self, step: int) -> bool:
        trainer = self.trainer
        if trainer.progress.nonfinite_step is not None or step in self.manager.all_steps():
            return False
        loss = trainer.report.last_loss
        return loss is None or math.isfinite(float(np.asarray(jax.device_get(loss))))

    def save(self, step: int, *, force: bool = False) -> bool:
        """Saves the run as it is now under ``step``; False if it is not saved (NaN, or saved)."""
        self._check_last_saved()
        if not self._savable(step):
            return False
        run = self.trainer.run_state()
        items: dict[str, Any] = {
            "state": ocp.args.StandardSave(run.state),
            "train_metrics": ocp.args.StandardSave(run.train_metrics),
            "meta": ocp.args.JsonSave(self._meta(step, run)),
        }
        if run.data is not None:  # where the next step's batch starts, even read ahead
            items["data"] = grain.checkpoint.CheckpointSave(as_position(run.data))
        pending = PendingSummary()
        items["fingerprints"] = FingerprintSave(pending)
        logged = self._seen.get(self.monitor) if self.monitor else None
        metric = logged[1] if logged is not None and logged[0] == step else None

        def summarize_state() -> None:
            summary = summarize(run.arrays())
            pending.set(summary)
            self._last_saved = (step, summary["finite"])

        if not self.async_save:  # save returns once written: the summary must be there
            summarize_state()
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
        return bool(saved)

    def _check_last_saved(self) -> None:
        """A saved state that turned out non-finite (a finite loss, NaN gradients) is
        moved aside as soon as that is known, so it never stays the latest step."""
        if self._last_saved is None:
            return
        step, finite = self._last_saved
        self._last_saved = None
        if not bool(np.asarray(finite.addressable_data(0))):
            self.manager.wait_until_finished()
            self._set_aside(
                self.manager, step, f"checkpoint step {step} holds non-finite values",
                label="nonfinite",
            )  # fmt: skip

    def _meta(self, step: int, run: RunState) -> dict[str, Any]:
        trainer = self.trainer
        return {
            **run.host(),
            "step": step,
            "data": "grain" if run.data is not None else "skip",
            "monitor": {self.monitor: self._seen.get(self.monitor)} if self.monitor else {},
            "versions": _versions(),
            "strategy": repr(trainer.strategy),
            "mesh": dict(trainer.mesh.shape),
            "num_processes": jax.process_count(),
            "config": _jsonable(trainer.config),
            "time": time.time(),
        }

    # -- restoring -------------------------------------------------------------------------
    def _candidates(self) -> tuple[ocp.CheckpointManager, list[int], bool]:
        """(manager, steps to try newest first, whether falling back is allowed)."""
        restore = self.restore
        if restore == "latest":
            return self.manager, self.steps()[::-1], True
        if restore == "best":
            return self.manager, self._by_monitor(), True
        if isinstance(restore, int):
            return self.manager, [restore], False
        assert restore is not None  # fit restores nothing then
        path = Path(os.fspath(restore)).absolute()  # a step directory, of any run
        if not path.name.isdigit():
            raise ValueError(f"restore={str(restore)!r} is not a step directory (…/<step>).")
        other = ocp.CheckpointManager(
            path.parent, options=ocp.CheckpointManagerOptions(read_only=True, create=False)
        )
        return other, [int(path.name)], False

    def _by_monitor(self) -> list[int]:
        scored = []
        for step in self.steps():
            value = (self.manager.metrics(step) or {}).get(self.monitor)
            if value is not None:
                scored.append((value if self.mode == "min" else -value, step))
        return [step for _, step in sorted(scored)]

    def restore_into_trainer(self) -> int | None:
        """Restores the ``restore`` choice into the trainer; the step restored, or None."""
        manager, candidates, fall_back = self._candidates()
        for step in candidates:
            damaged: DamagedCheckpoint | None = None
            try:
                saved = self._read_step(manager, step)
            except DamagedCheckpoint as error:
                damaged = error
            # Every process must take the same branch: one that read damage makes all skip.
            damaged = agree_on_damage(damaged, step, manager.directory)
            if damaged is None:
                self._apply(manager, step, saved)
                return step
            if not fall_back:
                raise damaged
            self._set_aside(manager, step, damaged)
        return None

    def _read_step(self, manager: ocp.CheckpointManager, step: int) -> dict[str, Any]:
        """The step's items, read into this trainer's layout and checked; nothing applied."""
        path = Path(manager.directory) / str(step)
        if not path.is_dir():
            found = sorted(manager.all_steps())
            raise FileNotFoundError(
                f"there is no checkpoint step {step} at {path} (steps there: {found or 'none'})."
            )
        target = self.trainer.run_state(abstract=True)  # shapes and layouts: no array built
        check_same_model(path, step, target.state)
        if not (path / "commit_success.txt").exists():
            raise DamagedCheckpoint(
                f"checkpoint step {step} at {path} has no commit marker: it was not finished"
            )
        try:
            saved = dict(
                manager.restore(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(target.state),
                        train_metrics=ocp.args.StandardRestore(target.train_metrics),
                        meta=ocp.args.JsonRestore(),
                        fingerprints=FingerprintRestore(),
                    ),
                )
            )
        except Exception as error:  # Orbax raises many kinds; all mean "cannot be read"
            raise DamagedCheckpoint(
                f"checkpoint step {step} at {path} cannot be read ({type(error).__name__}: "
                f"{str(error)[:300]})"
            ) from error
        record = saved["fingerprints"]
        if not record["finite"]:
            raise DamagedCheckpoint(
                f"checkpoint step {step} at {path} holds non-finite values (the run diverged "
                "before it was saved)"
            )
        bad = mismatches(
            record["leaves"], {"state": saved["state"], "train_metrics": saved["train_metrics"]}
        )
        if bad:
            raise DamagedCheckpoint(
                f"checkpoint step {step} at {path} is damaged: {len(bad)} leaves do not match "
                f"the fingerprints saved with them ({', '.join(bad[:5])})"
            )
        return saved

    def _apply(self, manager: ocp.CheckpointManager, step: int, saved: dict[str, Any]) -> None:
        meta = saved["meta"]
        self.restored_layouts = [leaf.sharding for leaf in jax.tree.leaves(saved["state"])]
        restore_data = None
        if meta["data"] == "grain":
            restore_data = lambda iterator: self._restore_iterator(manager, step, iterator, meta)  # noqa: E731
        arrays = {"state": saved["state"], "train_metrics": saved["train_metrics"]}
        self.trainer.load_run_state(RunState.from_saved(arrays, meta, data=restore_data))

    def _restore_iterator(
        self, manager: ocp.CheckpointManager, step: int, iterator: Any, meta: dict
    ) -> bool:
        if not has_position(iterator):
            return False  # the data given now is not a Grain pipeline: skip batches instead
        if int(meta.get("num_processes", 1)) != jax.process_count():
            # Grain saved one state file per process of the old count. A MapDataset
            # iterator's state is its index in batches, and every process of a
            # per-process pipeline (rows[i::n], batched to global/n) is at the same
            # index at a step, whatever n: set it from the run's own position.
            if set(iterator.get_state()) != {"next_index"}:
                return False  # another kind of pipeline: skip batches instead
            iterator.set_state({"next_index": int(meta["batches_in_epoch"])})
            return True
        manager.restore(
            step, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(iterator))
        )
        return True

    def _set_aside_later_than(self, step: int) -> None:
        """After restoring an older step (best, or by number), the later steps are moved
        aside so new saves from here are not refused; nothing is deleted."""
        for later in [s for s in self.steps() if s > step]:
            self._set_aside(
                self.manager, later, f"step {later} is later than restored step {step}",
                label=f"after-{step}", warn=False,
            )  # fmt: skip

    def _set_aside(
        self,
        manager: ocp.CheckpointManager,
        step: int,
        why: Exception | str,
        *,
        label: str = "damaged",
        warn: bool = True,
    ) -> None:
        path = Path(manager.directory) / str(step)
        aside = path.with_name(f"{step}.{label}")
        suffix = 1
        while aside.exists():
            aside, suffix = path.with_name(f"{step}.{label}-{suffix}"), suffix + 1
        if jax.process_index() == 0:
            path.rename(aside)  # kept for inspection: nothing is deleted automatically
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"set aside checkpoint {step}")
        manager.reload()
        message = f"{why}; moved to {aside}" + (" and restoring an earlier step." if warn else ".")
        if warn:
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        if self.report is not None:
            self.report(message)

    def _note(self, logs: Logs) -> None:
        for key, value in logs.items():
            self._seen[key] = (self.trainer.step, value)

    # -- hooks ------------------------------------------------------------------------------
    @override
    def on_fit_start(self, logs: Logs) -> None:
        self._seen = {}
        if self.restore is not None and not self._fitted:
            # Only the first fit resumes: a later fit of this trainer goes on from where
            # the previous one left its state, as it would without checkpoints.
            self.restored_step = self.restore_into_trainer()
            if self.restored_step is not None and self.report is not None:
                self.report(
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
        self._preemption.listen()

    @override
    def on_train_batch_end(self, step: int, logs: Logs) -> None:
        self._note(logs)

    @override
    def on_test_end(self, logs: Logs) -> None:
        self._note(logs)

    @override
    def on_step_end(self, step: int) -> None:
        # Everything about this step (its logs, its evaluation) is in the callbacks' states.
        if self._preemption.reached(step, self.manager):
            self._save_for_preemption(step)
        elif self.save_every_n_steps and step % self.save_every_n_steps == 0:
            self.save(step)

    def _save_for_preemption(self, step: int) -> None:
        self.save(step, force=True)
        self.manager.wait_until_finished()
        self.trainer.request_stop(preempted=True)
        if self.report is not None:
            self.report(f"preempted: saved step {step} in {self.directory}; run again to resume")

    @override
    def on_train_end(self, logs: Logs) -> None:
        self._note(logs)

    @override
    def on_fit_end(self, logs: Logs) -> None:
        try:
            self.save(self.trainer.step)  # the final state (a no-op if just saved)
            self.manager.wait_until_finished()
            self._check_last_saved()
        finally:
            self._preemption.stop()

    @override
    def on_exception(self, error: BaseException) -> None:
        self._preemption.stop()
        if self._manager is not None:
            self._manager.wait_until_finished()  # a save in flight completes; nothing half-done
