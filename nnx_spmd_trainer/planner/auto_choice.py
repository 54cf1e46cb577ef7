"""What ``strategy="auto"`` found: a row per candidate layout (``Candidate``) and the
choice with its ranking (``Choice``), shown through ``auto_table``."""

from __future__ import annotations

import dataclasses

from nnx_spmd_trainer.planner import auto_table
from nnx_spmd_trainer.planner.plan import Plan
from nnx_spmd_trainer.planner.plan_report import PlanReport
from nnx_spmd_trainer.strategies import Strategy


@dataclasses.dataclass
class Candidate:
    """One row of the ranking.

    Attributes:
      strategy: the layout; ``mesh`` its axes and sizes.
      status: ``"timed"``, ``"does not fit"``, ``"cannot split"``, or ``"resumed"`` (the
        layout of the run being resumed, kept untimed).
      reason: why it was not timed (``""`` when it was).
      state_bytes, peak_bytes: per device: the state the plan lays out, and the compiled
        step's peak (``PlanReport.memory["peak"]``); ``None`` when it could not be planned.
      step_time_s: median seconds per step over the rounds (timed candidates only).
      ratio: ``step_time_s`` over the fastest's.
      report: its ``PlanReport`` (``None`` when it could not be planned).
    """

    strategy: Strategy
    mesh: dict[str, int] = dataclasses.field(default_factory=dict)
    status: str = "cannot split"
    reason: str = ""
    state_bytes: int | None = None
    peak_bytes: int | None = None
    step_time_s: float | None = None
    ratio: float | None = None
    report: PlanReport | None = None
    times: list[float] = dataclasses.field(default_factory=list)

    @property
    def layout(self) -> str:
        return repr(self.strategy)

    def cells(self) -> list[str]:
        """layout, mesh, state, peak, step time, ratio (or why it was not timed)."""
        return auto_table.cells(self)


@dataclasses.dataclass
class Choice:
    """What ``choose`` found: the fastest layout that fits, and the ranking.

    Attributes:
      plan: the chosen layout's ``Plan`` (no state built: ``plan.materialize()``
        builds the initial state); ``strategy`` its strategy.
      rows: every candidate (``Candidate``), the timed ones fastest first, then those
        that do not fit (smallest peak first), then those that cannot split.
      budget_bytes: the per-device memory the candidates were checked against.
      steps, rounds: how they were timed.
      resumed: the layout of the run being resumed was taken, nothing timed.
    """

    plan: Plan
    rows: list[Candidate]
    budget_bytes: int | None
    steps: int
    rounds: int
    resumed: bool = False

    @property
    def strategy(self) -> Strategy:
        return self.plan.strategy

    @property
    def chosen(self) -> Candidate:
        return self.rows[0]

    @property
    def report(self) -> PlanReport:
        """The chosen layout's ``PlanReport``."""
        assert self.chosen.report is not None
        return self.chosen.report

    def title(self) -> str:
        """The line above the ranking: what was chosen, within what budget, timed how."""
        return auto_table.title(
            self.chosen.layout, self.budget_bytes, self.steps, self.rounds, self.resumed
        )

    def table(self) -> str:
        """The ranking as aligned text: what ``Trainer`` prints at the start of the run."""
        return auto_table.text_table(self.title(), self.rows)

    def markdown(self) -> str:
        """The ranking as a Markdown table (TensorBoard's text tab)."""
        return auto_table.markdown_table(self.title(), self.rows)

    def logs(self) -> dict[str, float]:
        """The choice as host floats for ``logs``: its step time (when timed), bytes,
        candidates timed, and its mesh (``layout/mesh/<axis>``: the size of each axis)."""
        chosen = self.chosen
        logs = {
            "layout/peak_bytes_per_device": float(chosen.peak_bytes or 0),
            "layout/state_bytes_per_device": float(chosen.state_bytes or 0),
            "layout/candidates_timed": float(sum(r.status == "timed" for r in self.rows)),
        }
        if chosen.step_time_s is not None:  # a resumed run's layout is not timed
            logs["layout/step_time_s"] = float(chosen.step_time_s)
        logs.update({f"layout/mesh/{axis}": float(n) for axis, n in chosen.mesh.items()})
        return logs

    def __str__(self) -> str:
        return self.table()
