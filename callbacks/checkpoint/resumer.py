"""CheckpointResumer: which step to restore, and restoring it; the part of ``OrbaxCheckpoint``
that reads.

The choice (``"latest"``, ``"best"``, a step number or a step directory), the candidates
of both tiers in the order they are tried, falling back past damaged ones, the step put
into a trainer (``load_run_state``), and, after an older step is restored, the later ones
set aside. Reading and checking one step is ``step_reader.py``'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import jax
import orbax.checkpoint as ocp

from nnx_spmd_trainer import RunState
from nnx_spmd_trainer.adapters import orbax_private

from . import format
from .checks import DamagedCheckpoint, agree_on_damage, check_same_model
from .reports import Reports
from .step_reader import SavedStep, read_meta, read_step
from .tiers import Tiers

if TYPE_CHECKING:
    from nnx_spmd_trainer import Trainer

Restore = Literal["latest", "best"] | int | str | os.PathLike[str] | None
#: One step of one tier: (the manager of its directory, the step).
Candidate = tuple[ocp.CheckpointManager, int]


@dataclasses.dataclass(frozen=True)
class Restored:
    """A step put into a trainer: which, from where, and the layouts its arrays arrived in."""

    step: int
    directory: Path
    layouts: list[Any]


class CheckpointResumer:
    """Restores the ``restore`` choice from ``tiers`` into a trainer.

    Args:
      tiers: the directories and their managers.
      restore: ``"latest"``, ``"best"``, a step number or a step directory (not None).
      monitor: the ``logs`` key ``"best"`` ranks by, or None.
      mode: ``"min"`` or ``"max"``: which ``monitor`` values are best.
      reports: where a step skipped as damaged is reported.
      trainable_only: the steps hold all but the model's frozen parameters
        (``format.kept_state``); a restore puts them over the trainer's first state.
    """

    def __init__(
        self,
        tiers: Tiers,
        *,
        restore: Restore,
        monitor: str | None,
        mode: Literal["min", "max"],
        reports: Reports,
        trainable_only: bool = False,
    ) -> None:
        self.tiers = tiers
        self.restore = restore
        self.trainable_only = trainable_only
        self.monitor = monitor
        self.mode = mode
        self.reports = reports

    @property
    def by_path(self) -> bool:
        """Whether ``restore`` is a step directory (read through a manager of its own)."""
        return self.restore not in ("latest", "best") and not isinstance(self.restore, int)

    def into_fit(self, trainer: Trainer) -> Restored | None:
        """What ``fit`` restores at its start: damaged steps moved aside, the tiers' own
        managers used (they go on to save)."""
        return self._restore(trainer, self.tiers.managers(), move_damaged=True)

    def into(self, trainer: Trainer) -> Restored | None:
        """Restores without writing anything: a damaged step is skipped and left where it
        is; read-only managers, closed after."""
        managers = [] if self.by_path else self.tiers.read_only()
        if not self.by_path and not managers:
            return None
        try:
            return self._restore(trainer, managers, move_damaged=False)
        finally:
            for manager in managers:  # everything is read, the data position too
                manager.close()

    # -- read-only questions -------------------------------------------------------------------
    def layout_to_resume(self) -> str | None:
        """The strategy of the step a restore would take first, from its metadata alone."""
        with self.step_to_resume() as (manager, step):
            if manager is None or step is None:
                return None
            try:
                return str(read_meta(manager, step)["strategy"])
            except Exception:  # Orbax raises many kinds; a damaged step is the restore's
                return None

    def check_model(self, trainer: Trainer) -> None:
        """Raises ``CheckpointOfAnotherModel`` if the step a restore would take first was
        written for another model or optimizer than ``trainer`` holds."""
        with self.step_to_resume() as (manager, step):
            if manager is not None and step is not None:
                state = trainer.run_state(abstract=True).state
                trained = trainer.plan.wrt if self.trainable_only else None
                kept = format.kept_state(state, trained)
                check_same_model(Path(manager.directory) / str(step), step, kept)

    @contextlib.contextmanager
    def step_to_resume(self) -> Iterator[tuple[ocp.CheckpointManager | None, int | None]]:
        """(a read-only manager, the step a restore would try first), closed after;
        ``(None, None)`` when no step would be restored or none can be listed."""
        opened: list[ocp.CheckpointManager] = []
        try:
            first: tuple[ocp.CheckpointManager | None, int | None] = (None, None)
            try:
                if not self.by_path:
                    opened.extend(self.tiers.read_only())
                if self.by_path or opened:
                    candidates, _ = self._candidates(opened)
                    opened.extend(m for m, _ in candidates)  # a step directory's own, closed too
                    first = candidates[0] if candidates else (None, None)
            except Exception:  # Orbax raises many kinds; the restore names what is wrong
                first = (None, None)
            yield first
        finally:
            for manager in dict.fromkeys(opened):  # each once
                manager.close()

    # -- the restore ---------------------------------------------------------------------------
    def _candidates(self, managers: list[ocp.CheckpointManager]) -> tuple[list[Candidate], bool]:
        """(the steps to try, first first, each with its tier's manager; whether falling
        back is allowed). ``managers``: each tier's, the persistent first; unused when
        ``restore`` is a step directory. Where both tiers hold a step, the persistent
        one's copy is tried first."""
        restore = self.restore
        assert restore is not None  # nothing is restored then
        if not self.by_path:
            tiers = [(tier, manager, step) for tier, manager in enumerate(managers)
                     for step in self.tiers.steps_of(manager)]  # fmt: skip
            if restore == "latest":
                newest = sorted(tiers, key=lambda t: (-t[2], t[0]))
                return [(manager, step) for _, manager, step in newest], True
            if restore == "best":
                return self._by_monitor(tiers), True
            held = [(manager, step) for _, manager, step in tiers if step == restore]
            return (held or [(managers[0], int(restore))])[:1], False  # type: ignore[arg-type]
        path = Path(os.fspath(restore)).absolute()  # type: ignore[arg-type]
        if not path.name.isdigit():
            raise ValueError(f"restore={str(restore)!r} is not a step directory (…/<step>).")
        with orbax_private.quiet_listing():
            options = ocp.CheckpointManagerOptions(read_only=True, create=False)
            other = ocp.CheckpointManager(path.parent, options=options)
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
    ) -> Restored | None:
        candidates, fall_back = self._candidates(managers)
        for manager, step in candidates:
            damaged: DamagedCheckpoint | None = None
            try:
                saved = read_step(trainer, manager, step, trainable_only=self.trainable_only)
            except DamagedCheckpoint as error:
                damaged = error
            # Every process must take the same branch: one that read damage makes all skip.
            damaged = agree_on_damage(damaged, step, manager.directory)
            if damaged is None:
                return _apply(
                    trainer, saved, step, Path(manager.directory),
                    trainable_only=self.trainable_only,
                )  # fmt: skip
            if not fall_back:
                raise damaged
            if move_damaged:
                aside = self.tiers.set_aside(manager, step, "damaged")
                self.reports.trouble(f"{damaged}; moved to {aside} and restoring an earlier step.")
            else:
                self.reports.trouble(f"{damaged}; restoring an earlier step (left where it is).")
        return None

    def set_aside_later_than(self, step: int) -> None:
        """After restoring an older step (best, or by number), the later steps are moved
        aside so new saves from here are not refused; nothing is deleted."""
        for manager in self.tiers.managers():
            for later in [s for s in self.tiers.steps_of(manager) if s > step]:
                aside = self.tiers.set_aside(manager, later, f"after-{step}")
                self.reports.news(
                    f"step {later} is later than restored step {step}; moved to {aside}."
                )


def _apply(
    trainer: Trainer, saved: SavedStep, step: int, directory: Path, *, trainable_only: bool
) -> Restored:
    state = saved.state
    if trainable_only:  # the frozen base: the trainer's first state (init_from), built now
        state = format.onto_base(trainer.run_state().state, saved.state)
    arrays = {"state": state, "train_metrics": saved.train_metrics}  # RunState's fields
    callback_arrays = {
        key: saved.callback_arrays[name]
        for key, name in format.saved_callbacks(saved.meta).items()
        if name in saved.callback_arrays
    }
    trainer.load_run_state(
        RunState.from_saved(arrays, saved.meta, callback_arrays=callback_arrays, data=saved.data)
    )
    layouts = [leaf.sharding for leaf in jax.tree.leaves(saved.state)]
    return Restored(step=step, directory=directory, layouts=layouts)
