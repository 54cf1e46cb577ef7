"""Choosing for chips that are not here: ``strategy="auto"`` on a ``Target`` ranks the
layouts by the TPU compiler's verdict and the roofline step time, and
``largest_batch`` finds the largest global batch that fits, by doubling and bisection.

Nothing is timed (no chip is here to run on): a candidate that fits is ranked by its
``step time >=`` bound (``target_report.roofline``), which the run may not reach.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import optax

from nnx_spmd_trainer.planner import auto, auto_table, plan_report
from nnx_spmd_trainer.planner.auto_choice import Candidate, Choice
from nnx_spmd_trainer.planner.plan import Plan, abstract_batch
from nnx_spmd_trainer.planner.state import ModelFactory
from nnx_spmd_trainer.sharding import ShardingError
from nnx_spmd_trainer.strategies import Strategy

Lower = Callable[[Plan, Any], Any]


@dataclasses.dataclass
class TargetChoice(Choice):
    """``Choice`` made by the compiler and the roofline, not by timing: ``step time``
    in its table is the bound (``target_report.roofline``)."""

    target: str = ""

    def title(self) -> str:
        budget = f"{plan_report.size(self.budget_bytes)} per chip" if self.budget_bytes else ""
        return (
            f'strategy="auto" chose {self.chosen.layout} for {self.target} ({budget}; '
            "compiled by the TPU compiler, ranked by the roofline step time bound, not timed)"
        )

    def table(self) -> str:
        return auto_table.text_table(self.title(), self.rows)


def _bound(report: plan_report.PlanReport) -> float:
    times = report.target.get("roofline") or {}
    return float(times.get("bound_s") or report.step_time_bound_s or 0.0)


def choose(
    model: ModelFactory,
    optimizer: optax.GradientTransformation,
    batch: Any,
    *,
    devices: Sequence[jax.Device],
    loss_fn: Any = None,
    strategies: Sequence[Strategy] | None = None,
    memory_budget_bytes: int | None = None,
    lower: Lower | None = None,
    target: str = "",
    **plan_kwargs: Any,
) -> TargetChoice:
    """Every candidate layout planned on ``devices`` (a ``Target``'s chips) and compiled
    from ``batch``'s shapes; the one that fits with the smallest step-time bound.

    Raises:
      auto.NoLayoutFits: none fits; the message lists each one's bytes."""
    shapes = abstract_batch(batch)
    if strategies is None:
        strategies = auto.candidates(len(devices))
    lower = lower or (lambda plan, shapes: plan.lower(shapes))
    rows: list[Candidate] = []
    fitting: list[tuple[Candidate, Plan]] = []
    budget = memory_budget_bytes
    for strategy in strategies:
        row = Candidate(strategy)
        rows.append(row)
        try:
            plan = Plan(
                model, optimizer, strategy=strategy, loss_fn=loss_fn, devices=devices, **plan_kwargs
            )
            row.mesh = {str(k): int(v) for k, v in plan.mesh.shape.items()}
            unused = [a for a in auto._layer_axes(strategy) if a not in auto._axes_used(plan)]
            if unused:
                row.reason = f"no dimension of the model is annotated for the {unused[0]!r} axis"
                continue
            report = plan_report.compiled_report(
                plan, lower(plan, shapes), memory_budget_bytes=memory_budget_bytes
            )
        except (ShardingError, ValueError) as error:
            row.reason = auto._first_line(error)
            continue
        budget = report.budget_bytes
        row.report, row.peak_bytes = report, report.memory["peak"]
        row.state_bytes = sum(r["bytes_per_device"] for r in report.leaves)
        if report.fits is False:
            row.status, row.reason = "does not fit", report.verdict
            continue
        row.status, row.step_time_s = "bounded", _bound(report)
        fitting.append((row, plan))
    if not fitting:
        raise auto._nothing_fits(rows, budget)
    best = min(row.step_time_s or 0.0 for row, _ in fitting)
    for row, _ in fitting:
        row.ratio = (row.step_time_s or 0.0) / best if best > 0 else 1.0
    order = {"bounded": 0, "does not fit": 1, "cannot split": 2}
    rows.sort(key=lambda r: (order[r.status], r.step_time_s or 0.0, r.peak_bytes or 0))
    chosen = next(plan for row, plan in fitting if row is rows[0])
    return TargetChoice(
        plan=chosen, rows=rows, budget_bytes=budget, steps=0, rounds=0, target=target
    )


@dataclasses.dataclass
class BatchSearch:
    """What ``largest_batch`` found: the largest global batch that fits (0: none), its
    report, and every compile it took (rows, fits, peak per chip)."""

    rows: int
    report: plan_report.PlanReport | None
    compiles: list[tuple[int, bool, int]]

    def lines(self) -> list[str]:
        tried = ", ".join(
            f"{n} {'fits' if ok else 'no'} ({plan_report.size(peak)})"
            for n, ok, peak in self.compiles
        )
        found = f"{self.rows} rows" if self.rows else "no batch (not even the smallest)"
        return [f"largest global batch that fits: {found}; {len(self.compiles)} compiles: {tried}"]


def largest_batch(
    plan: Plan,
    batch_of: Callable[[int], Any],
    *,
    start: int,
    step: int = 1,
    limit: int = 1 << 20,
    within: float = 0.0,
    memory_budget_bytes: int | None = None,
    lower: Lower | None = None,
) -> BatchSearch:
    """The largest global batch ``batch_of(rows)`` (shapes) whose step fits ``plan``'s
    devices: doubling from ``start`` until one does not fit, then bisection between
    the last that fit and the first that did not, in multiples of ``step`` (rows the
    mesh's batch axes and accumulation divide), until they are ``step`` apart, or
    ``within`` (a fraction) of the one that fits: fewer compiles, a coarser answer."""
    lower = lower or (lambda plan, shapes: plan.lower(shapes))
    compiles: list[tuple[int, bool, int]] = []
    reports: dict[int, plan_report.PlanReport] = {}

    def fits(rows: int) -> bool:
        report = plan_report.compiled_report(
            plan,
            lower(plan, abstract_batch(batch_of(rows))),
            memory_budget_bytes=memory_budget_bytes,
        )
        ok = report.fits is not False
        compiles.append((rows, ok, int(report.memory["peak"])))
        if ok:
            reports[rows] = report
        return ok

    good, bad = 0, 0
    rows = max(step, start - start % step)
    while rows <= limit:
        if not fits(rows):
            bad = rows
            break
        good, rows = rows, rows * 2
    if bad == 0:
        return BatchSearch(good, reports.get(good), compiles)
    while bad - good > max(step, within * good):
        middle = (good + bad) // 2 // step * step
        if middle <= good:
            break
        if fits(middle):
            good = middle
        else:
            bad = middle
    return BatchSearch(good, reports.get(good), compiles)
