"""Tiers: the directories a checkpoint lives in, and an Orbax manager for each.

``directory`` is the persistent tier; ``local_directory``, when given, a second, fast one
saved more often. Both the writer and the resumer reach a tier through the manager this
object opens: with the keep policy, quiet about what it opens on purpose (read-only
managers), and with the steps a kill left half-deleted cleaned first. A step is moved
aside here too (``set_aside``), never deleted.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from orbax.checkpoint import checkpoint_managers as policies

from nnx_spmd_trainer import RunLock
from nnx_spmd_trainer.adapters import orbax_private
from nnx_spmd_trainer.distributed import agree

from .save_errors import CheckpointWriteError


class Tiers:
    """Each tier's directory and manager, the persistent one first.

    Args:
      directory: the persistent tier.
      local_directory: the frequent tier, or None.
      keep: how many of the latest steps each tier keeps (None: all).
      monitor: the ``logs`` key of ``keep_best`` and ``restore="best"``, or None.
      mode: ``"min"`` or ``"max"``: which ``monitor`` values are best.
      keep_best: also keep this many best steps by ``monitor``.
      async_save: whether saves return before the write is done.
    """

    def __init__(
        self,
        directory: Path,
        local_directory: Path | None,
        *,
        keep: int | None,
        monitor: str | None,
        mode: Literal["min", "max"],
        keep_best: int | None,
        async_save: bool,
    ) -> None:
        self.directory = directory
        self.local_directory = local_directory
        self.keep = keep
        self.monitor = monitor
        self.mode = mode
        self.keep_best = keep_best
        self.async_save = async_save
        self._persistent: ocp.CheckpointManager | None = None
        self._local: ocp.CheckpointManager | None = None
        # Half-deleted steps a read-only manager still lists (nothing is removed then).
        self._leftovers: dict[Path, set[int]] = {}
        #: One run writes a tier at a time: each directory's lock, the persistent first.
        self.locks = [RunLock(d) for d in (directory, local_directory) if d is not None]

    # -- the locks -------------------------------------------------------------------------
    def lock(self) -> None:
        """Takes every tier's lock (process 0: the others write only shards): raises
        ``DirectoryInUse`` naming the other run's process, or ``CheckpointWriteError``
        for a directory this process cannot write, before anything is trained."""
        if jax.process_index() != 0:
            return
        for lock in self.locks:
            try:
                lock.acquire()
            except OSError as error:
                raise CheckpointWriteError(
                    f"OrbaxCheckpoint cannot write {lock.directory} ({error.strerror}), so "
                    "no checkpoint could be saved; nothing was trained. Give a directory "
                    "this process can write, or fix its permissions (a read-only or full "
                    "file system)."
                ) from error

    def release(self) -> None:
        for lock in self.locks:
            lock.release()

    # -- the managers ----------------------------------------------------------------------
    @property
    def persistent(self) -> ocp.CheckpointManager:
        """The manager of ``directory`` (created on first use, and the directory with it)."""
        if self._persistent is None:
            self._persistent = self.open(self.directory)
        return self._persistent

    @property
    def local(self) -> ocp.CheckpointManager | None:
        """The manager of ``local_directory`` (None without a local tier)."""
        if self._local is None and self.local_directory is not None:
            self._local = self.open(self.local_directory)
        return self._local

    def managers(self) -> list[ocp.CheckpointManager]:
        """Every tier's manager, the persistent one first."""
        local = self.local
        return [self.persistent] if local is None else [self.persistent, local]

    def opened(self) -> list[ocp.CheckpointManager]:
        """The writable managers opened so far (nothing is opened here)."""
        return [m for m in (self._persistent, self._local) if m is not None]

    def read_only(self) -> list[ocp.CheckpointManager]:
        """A read-only manager of each tier's directory that exists, the persistent first;
        the caller closes them."""
        tiers = [self.directory, self.local_directory]
        return [self.open(tier, read_only=True) for tier in tiers if tier and tier.is_dir()]

    def open(self, directory: Path, *, read_only: bool = False) -> ocp.CheckpointManager:
        """A manager of ``directory`` with this checkpoint's keep policy.

        Writable: the steps a killed deletion left half-deleted are removed first (Orbax's
        policy had already dropped them). Read-only: they stay, unlisted by ``steps_of``."""
        leftovers = self._leftovers_in(directory, agreed=not read_only)
        if leftovers and not read_only:
            _finish_deleting(directory, leftovers)
            leftovers = []
        self._leftovers[directory] = {int(p.name) for p in leftovers}
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
        monitored = self.monitor
        with orbax_private.quiet_listing(leftovers):
            options = ocp.CheckpointManagerOptions(
                enable_async_checkpointing=self.async_save,
                preservation_policy=policies.AnyPreservationPolicy(preserve),
                # With a best_fn Orbax also writes each step's metrics, read back by "best".
                best_fn=(lambda metrics: metrics[monitored]) if monitored else None,
                best_mode=self.mode,
                create=not read_only,
                read_only=read_only,
            )
            # Orbax's own preemption checks stay away from JAX's (PreemptionNotice's).
            return orbax_private.QuietManager(directory, options=options)

    def _leftovers_in(self, directory: Path, *, agreed: bool) -> list[Path]:
        """The step directories of ``directory`` that Orbax's deletion left half-done:
        without Orbax's step metadata, and with at least ``keep`` newer steps beside them
        (so the keep policy had dropped them). ``agreed``: process 0 decides for every
        process (where they all open the tier for writing, at the same point)."""
        found: list[str] = []
        decides = jax.process_index() == 0 or not agreed
        if decides and self.keep is not None and directory.is_dir():
            steps = sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())
            whole = [s for s in steps if not orbax_private.lacks_step_metadata(directory / str(s))]
            found = [
                str(directory / str(step))
                for step in steps
                if step not in whole and sum(s > step for s in whole) >= self.keep
            ]
        if agreed and jax.process_count() > 1:
            found = agree.broadcast_from_first(f"half-deleted checkpoints: {directory}", found)
        return [Path(p) for p in found]

    # -- steps -----------------------------------------------------------------------------
    def check_not_ahead_of(self, step: int) -> None:
        """Raises ``ValueError`` where a tier holds steps after ``step``: new saves there
        would be refused."""
        for manager in self.managers():
            latest = manager.latest_step()
            if latest is not None and latest > step:
                raise ValueError(
                    f"{manager.directory} already holds checkpoints up to step {latest}, ahead "
                    f"of this run's step {step}, and new steps there would be refused. Resume "
                    "them (restore='latest') or save this run in another directory."
                )

    def steps_of(self, manager: ocp.CheckpointManager) -> list[int]:
        """The steps ``manager`` holds, oldest first, half-deleted ones left out."""
        leftovers = self._leftovers.get(Path(manager.directory), set())
        return sorted(s for s in manager.all_steps() if s not in leftovers)

    def where(self, directory: Path) -> str:
        """``directory`` as a line names it: with its tier when there are two."""
        if self.local_directory is None:
            return str(directory)
        if directory == self.local_directory:
            return f"{directory} (the local tier)"
        if directory == self.directory:
            return f"{directory} (the persistent tier)"
        return str(directory)

    def set_aside(self, manager: ocp.CheckpointManager, step: int, label: str) -> Path:
        """Moves ``step`` of ``manager``'s tier to ``<step>.<label>`` (a free name), kept for
        inspection, and has the manager list its steps again; the new path."""
        path = Path(manager.directory) / str(step)
        aside = path.with_name(f"{step}.{label}")
        suffix = 1
        while aside.exists():
            aside, suffix = path.with_name(f"{step}.{label}-{suffix}"), suffix + 1
        if jax.process_index() == 0:
            path.rename(aside)  # nothing is deleted automatically
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"set aside checkpoint {step}")
        with orbax_private.quiet_listing():
            manager.reload()
        return aside


def _finish_deleting(directory: Path, leftovers: Sequence[Path]) -> None:
    """Removes what Orbax began to delete (process 0; the others wait for it)."""
    if jax.process_index() == 0:
        for step_dir in leftovers:
            shutil.rmtree(step_dir, ignore_errors=True)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"half-deleted checkpoints removed: {directory}")
