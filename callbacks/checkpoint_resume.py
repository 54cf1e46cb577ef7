"""CheckpointResume: the restore side of ``OrbaxCheckpoint``, a base class of it.

Which step to restore (``"latest"``, ``"best"``, a step number or a step directory),
restoring it into a trainer (the ``fit`` that starts, or any trainer by
``restore_into``), falling back past damaged steps, and, after an older step is
restored, the later ones set aside. Reading and checking one step is
``checkpoint_restore``'s; saving and the managers are ``checkpoint_writer``'s (its
subclass), the hooks ``OrbaxCheckpoint``'s.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import jax
import orbax.checkpoint as ocp
from typing_extensions import override

from nnx_spmd_trainer import Callback, RunState

from .checkpoint_checks import DamagedCheckpoint, agree_on_damage, check_same_model
from .checkpoint_restore import read_meta, read_step, set_aside

if TYPE_CHECKING:
    from nnx_spmd_trainer import Trainer

Restore = Literal["latest", "best"] | int | str | os.PathLike[str] | None
#: One step of one tier: (the manager of its directory, the step).
Candidate = tuple[ocp.CheckpointManager, int]


class _ReadOnlyNotes(logging.Filter):
    """Orbax warns whenever a read-only manager opens, as restores and layout reads here
    do on purpose: those two lines tell the user nothing."""

    NOTES = ("CheckpointManagerOptions.read_only=True", "Given directory is read only")

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.NOTES)


logging.getLogger("absl").addFilter(_ReadOnlyNotes())


class CheckpointResume(Callback):
    """The restore side of ``OrbaxCheckpoint`` (its base class; everything here works on
    ``OrbaxCheckpoint``'s settings, its manager and its ``restored_*`` attributes)."""

    if TYPE_CHECKING:  # OrbaxCheckpoint's (its __init__ and its manager section)
        directory: Path
        local_directory: Path | None
        monitor: str | None
        mode: Literal["min", "max"]
        restore: Restore
        print_fn: Callable[[str], None] | None
        restored_step: int | None
        restored_layouts: list[Any]
        _fitted: bool
        _restored_into: Trainer | None

        @property
        def manager(self) -> ocp.CheckpointManager: ...

        def _make_manager(
            self, directory: Path, *, read_only: bool = False
        ) -> ocp.CheckpointManager: ...

        def steps(self) -> list[int]: ...

        def _managers(self) -> list[ocp.CheckpointManager]: ...

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
        # A step directory is read through a manager of its own.
        managers = [] if by_path else self._read_only_managers()
        if not by_path and not managers:
            self.restored_step = None
            return None
        try:
            step = self._restore(trainer, managers, move_damaged=False)
        finally:
            for manager in managers:  # everything is read, the data position too
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

    def resumes(self) -> bool:
        """Whether the next ``fit`` would restore a step (read-only: nothing is created)."""
        with self._step_to_resume() as (_, step):
            return step is not None

    @contextlib.contextmanager
    def _step_to_resume(self) -> Iterator[tuple[ocp.CheckpointManager | None, int | None]]:
        """(a read-only manager, the step the next ``fit`` would restore first), closed
        after; ``(None, None)`` when no step would be restored or none can be listed."""
        by_path = self.restore not in ("latest", "best") and not isinstance(self.restore, int)
        if self.restore is None or self._fitted:
            yield None, None
            return
        opened: list[ocp.CheckpointManager] = []
        try:
            first: tuple[ocp.CheckpointManager | None, int | None] = (None, None)
            try:
                if not by_path:
                    opened.extend(self._read_only_managers())
                if by_path or opened:
                    candidates, _ = self._candidates(opened)
                    opened.extend(m for m, _ in candidates)  # a step directory's own, closed too
                    first = candidates[0] if candidates else (None, None)
            except Exception:  # Orbax raises many kinds; the restore names what is wrong
                first = (None, None)
            yield first
        finally:
            for manager in dict.fromkeys(opened):  # each once
                manager.close()

    def _read_only_managers(self) -> list[ocp.CheckpointManager]:
        """A read-only manager of each tier's directory that exists, the persistent first."""
        tiers = [self.directory, self.local_directory]
        return [
            self._make_manager(tier, read_only=True)
            for tier in tiers
            if tier is not None and tier.is_dir()
        ]

    def restore_into_trainer(self) -> int | None:
        """What ``fit`` restores at its start: the ``restore`` choice into this callback's
        trainer, moving damaged steps aside. Prefer ``restore_into(trainer)``."""
        return self._restore(self.trainer, self._managers(), move_damaged=True)

    def _candidates(self, managers: list[ocp.CheckpointManager]) -> tuple[list[Candidate], bool]:
        """(the steps to try, first first, each with its tier's manager; whether falling
        back is allowed). ``managers``: each tier's, the persistent first; unused when
        ``restore`` is a step directory. Where both tiers hold a step, the persistent
        one's copy is tried first."""
        restore = self.restore
        assert restore is not None  # nothing is restored then
        if restore in ("latest", "best") or isinstance(restore, int):
            tiers = [(tier, manager, step) for tier, manager in enumerate(managers)
                     for step in manager.all_steps()]  # fmt: skip
            if restore == "latest":
                newest = sorted(tiers, key=lambda t: (-t[2], t[0]))
                return [(manager, step) for _, manager, step in newest], True
            if restore == "best":
                return self._by_monitor(tiers), True
            held = [(manager, step) for _, manager, step in tiers if step == restore]
            return (held or [(managers[0], int(restore))])[:1], False  # absent: named
        path = Path(os.fspath(restore)).absolute()  # a step directory, of any run
        if not path.name.isdigit():
            raise ValueError(f"restore={str(restore)!r} is not a step directory (…/<step>).")
        other = ocp.CheckpointManager(
            path.parent, options=ocp.CheckpointManagerOptions(read_only=True, create=False)
        )
        return [(other, int(path.name))], False

    def _by_monitor(self, tiers: list[tuple[int, ocp.CheckpointManager, int]]) -> list[Candidate]:
        scored = []
        for tier, manager, step in sorted(tiers, key=lambda t: (t[2], t[0])):
            value = (manager.metrics(step) or {}).get(self.monitor)
            if value is not None:
                scored.append((value if self.mode == "min" else -value, step, tier, manager))
        return [(manager, step) for _, step, _, manager in sorted(scored, key=lambda s: s[:3])]

    def _restore(
        self, trainer: Trainer, managers: list[ocp.CheckpointManager], *, move_damaged: bool
    ) -> int | None:
        """Restores the ``restore`` choice into ``trainer``; the step restored, or None."""
        candidates, fall_back = self._candidates(managers)
        for manager, step in candidates:
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
        for manager in self._managers():
            for later in [s for s in sorted(manager.all_steps()) if s > step]:
                set_aside(
                    manager, later, f"step {later} is later than restored step {step}",
                    label=f"after-{step}", warn=False, print_fn=self.print_fn,
                )  # fmt: skip
