"""CheckpointWriter: the saving side of ``OrbaxCheckpoint``, a base class of it.

Each tier's ``CheckpointManager`` (``directory``, and ``local_directory`` when given),
and saving one step into one of them: what a step holds, when a step may not be
saved (a non-finite one), waiting for the write in flight, and a saved state that
turned out non-finite set aside. The restore side is its base class,
``checkpoint_resume.CheckpointResume``; the settings and the hooks that decide when
to save are ``OrbaxCheckpoint``'s.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from nnx_spmd_trainer import RunState, as_position

from .checkpoint_items import callback_items, jsonable, on_devices, versions
from .checkpoint_restore import set_aside
from .checkpoint_resume import CheckpointResume
from .checkpoint_save import check_writable, writing
from .checkpoint_timer import SaveTimer
from .fingerprint import FingerprintSave, PendingSummary, summarize
from .preemption import QuietManager


class CheckpointWriter(CheckpointResume):
    """The saving side of ``OrbaxCheckpoint`` (its base class; everything here works on
    ``OrbaxCheckpoint``'s settings, set by its ``__init__``)."""

    if TYPE_CHECKING:  # OrbaxCheckpoint's (its __init__)
        directory: Path
        local_directory: Path | None
        keep: int | None
        monitor: str | None
        mode: Literal["min", "max"]
        keep_best: int | None
        async_save: bool
        print_fn: Callable[[str], None] | None
        _timer: SaveTimer | None
        _seen: dict[str, tuple[int, float]]
        _last_saved: tuple[ocp.CheckpointManager, int, jax.Array] | None
        _writing: tuple[Path, int] | None
        _manager: ocp.CheckpointManager | None
        _local_manager: ocp.CheckpointManager | None

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

    @property
    def local_manager(self) -> ocp.CheckpointManager | None:
        """The manager of ``local_directory`` (None without a local tier)."""
        if self._local_manager is None and self.local_directory is not None:
            self._local_manager = self._make_manager(self.local_directory)
        return self._local_manager

    def _managers(self) -> list[ocp.CheckpointManager]:
        """Every tier's manager, the persistent one first."""
        local = self.local_manager
        return [self.manager] if local is None else [self.manager, local]

    def steps(self) -> list[int]:
        """The committed steps in ``directory``, oldest first."""
        return sorted(self.manager.all_steps())

    def local_steps(self) -> list[int]:
        """The committed steps in ``local_directory``, oldest first ([] without one)."""
        local = self.local_manager
        return [] if local is None else sorted(local.all_steps())

    # -- saving --------------------------------------------------------------------------
    def _savable(self, step: int, manager: ocp.CheckpointManager) -> bool:
        trainer = self.trainer
        if step in manager.all_steps():
            return False
        if trainer.plan.skip_nonfinite_updates:
            # A non-finite step changed nothing: the state is the finite steps' (and the
            # saved state's own finiteness check still runs, _check_last_saved).
            return True
        if trainer.progress.nonfinite_step is not None:
            return False
        record = trainer.last_step  # the step saved: saving waits for it anyway
        return record is None or math.isfinite(record.loss_value())

    def save(self, step: int, *, force: bool = False, local: bool = False) -> bool:
        """Saves the run as it is now under ``step``; False if it is not saved (NaN, or saved).

        ``local``: to ``local_directory`` (the frequent tier) instead of ``directory``.
        A step that cannot be written, now or by the background write of an earlier
        save, raises ``CheckpointWriteError`` naming that step and its directory."""
        if local and self.local_directory is None:
            raise ValueError("save(local=True) needs OrbaxCheckpoint(local_directory=...).")
        directory = self.local_directory if local else self.directory
        manager = self.local_manager if local else self.manager
        assert directory is not None and manager is not None
        self._finish_writing()
        self._check_last_saved()
        if not self._savable(step, manager):
            return False
        check_writable(directory, step)
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
        if saved and not local and self._timer is not None:
            self._timer.restart()  # the seconds count from this save
        return bool(saved)

    def _finish_writing(self) -> None:
        """Waits for the save in flight; its failure raises ``CheckpointWriteError``."""
        directory, step = self._writing or (self.directory, None)
        with writing(directory, step):
            for manager in (self._manager, self._local_manager):
                if manager is not None:
                    manager.wait_until_finished()
        self._writing = None

    def _check_last_saved(self) -> None:
        """A saved state that turned out non-finite (a finite loss, NaN gradients) is
        moved aside as soon as that is known, so it never stays the latest step."""
        if self._last_saved is None:
            return
        manager, step, finite = self._last_saved
        self._last_saved = None
        if not bool(np.asarray(finite.addressable_data(0))):
            self._finish_writing()
            set_aside(
                manager, step, f"checkpoint step {step} holds non-finite values",
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
