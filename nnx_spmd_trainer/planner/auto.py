"""``strategy="auto"``: plan every layout the devices allow, time those that fit, take the fastest.

Each candidate is planned from shapes alone (``Plan`` and its compiled train
step: ``PlanReport``), so one that does not fit the per-device memory never
has its state built. The candidates that fit are timed on real batches, a
few steps each, taking turns round after round (the median of the rounds),
with only one candidate's state on the devices at a time and every array of a
timing deleted after it: what stays is the chosen ``Plan``, whose state is
then built afresh (the initial state, as if the layout had been given).

This module enumerates and ranks; timing a candidate is the engine's, handed to
``choose`` (``TimeSteps``: ``engine.timing.time_steps``). The rows are
``auto_choice``'s, the tables ``auto_table``'s; process 0's answers reach every
process through ``distributed.agree``; the data read ahead is set back by
``data.position.look_ahead``.

>>> candidates(8, tp_sizes=[2])  # doctest: +NORMALIZE_WHITESPACE
[DataParallel(), FSDP(), Hybrid(DataParallel(4), TensorParallel(2)),
 Hybrid(FSDP(4), TensorParallel(2))]
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import statistics
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import jax
import optax
from flax import nnx

from nnx_spmd_trainer import deprecation
from nnx_spmd_trainer.data.placement import Placement
from nnx_spmd_trainer.data.position import look_ahead
from nnx_spmd_trainer.data.to_host import delete_arrays
from nnx_spmd_trainer.data_shard import DataShard
from nnx_spmd_trainer.distributed import agree
from nnx_spmd_trainer.planner import plan_report
from nnx_spmd_trainer.planner.auto_choice import Candidate, Choice
from nnx_spmd_trainer.planner.auto_table import HEADER as HEADER
from nnx_spmd_trainer.planner.plan import Plan, abstract_batch
from nnx_spmd_trainer.planner.plan_report import size
from nnx_spmd_trainer.planner.state import ModelFactory
from nnx_spmd_trainer.sharding import ShardingError
from nnx_spmd_trainer.strategies import FSDP, DataParallel, Hybrid, Strategy, TensorParallel, expert

#: How a candidate's train step is lowered: ``(plan, global batch shapes) -> Lowered``.
Lower = Callable[[Plan, Any], jax.stages.Lowered]


class TimeSteps(Protocol):
    """How ``choose`` has a candidate timed (``engine.timing.time_steps``): seconds per
    step of ``compiled`` over ``batches`` (placed on ``plan``'s mesh) from a fresh state
    of ``plan``, each step taken as ``fit`` takes it, every array it built deleted after."""

    def __call__(self, plan: Plan, compiled: Any, batches: Sequence[Any]) -> float: ...


class LayoutNotChosen(RuntimeError):
    """``Trainer(strategy="auto")``'s plan, mesh or state was asked for before the layout
    was chosen (``fit`` or ``choose_layout``)."""


def not_chosen(name: str) -> LayoutNotChosen:
    """The error for ``trainer.<name>`` asked for before the layout was chosen."""
    return LayoutNotChosen(
        f"trainer.{name}: Trainer(strategy='auto') has no layout yet (plan, mesh, "
        "placement, state): it chooses one on real batches. Call "
        "trainer.fit(data, ...) or trainer.choose_layout(batches) first."
    )


class NoLayoutFits(ValueError):
    """No candidate layout fits the per-device memory; the message lists each one's bytes."""


@deprecation.renamed_keywords(report="print_fn")
@dataclasses.dataclass(frozen=True)
class Auto:
    """``strategy="auto"`` with its settings: ``Trainer(..., strategy=Auto(steps=5))``.

    Attributes:
      memory_budget_bytes: per device; a candidate whose compiled step's peak is
        over it is not timed. Default: the device's own limit where it reports one
        (GPUs, TPUs), else no limit (the CPU).
      candidates: the strategies to choose from; default ``candidates(devices)``.
      steps: train steps each candidate is timed for in a round (on the first
        ``steps`` batches).
      rounds: timed rounds (after one untimed round); each candidate's time is the
        median of its rounds.
      print_fn: where the ranking table goes (default ``print``; ``None``: nowhere), as
        Keras's ``summary(print_fn=...)``. ``report=`` is its deprecated name.
    """

    memory_budget_bytes: int | None = None
    candidates: Sequence[Strategy] | None = None
    steps: int = 3
    rounds: int = 3
    print_fn: Callable[[str], Any] | None = print

    report = deprecation.renamed_property("Auto.report", "Auto.print_fn", lambda a: a.print_fn)

    def __post_init__(self) -> None:
        if self.steps < 1 or self.rounds < 1:
            raise ValueError(f"Auto needs steps >= 1 and rounds >= 1, got {self}.")


def as_auto(strategy: Any, memory_budget_bytes: int | None = None) -> Auto | None:
    """``Auto`` for ``strategy="auto"`` or an ``Auto``; ``None`` for a strategy object."""
    if isinstance(strategy, str):
        if strategy.strip().lower() != "auto":
            raise ValueError(
                f"strategy={strategy!r}: the only strategy given by name is 'auto'; otherwise "
                "give a strategy object (DataParallel(), FSDP(), Hybrid(FSDP(4), "
                "TensorParallel(2)))."
            )
        strategy = Auto()
    if isinstance(strategy, Auto):
        if memory_budget_bytes is not None:
            strategy = dataclasses.replace(strategy, memory_budget_bytes=memory_budget_bytes)
        return strategy
    if memory_budget_bytes is not None:
        raise TypeError(
            "memory_budget_bytes is what strategy='auto' chooses within; with a strategy of "
            "your own, check the fit with Plan(...).report(shapes, memory_budget_bytes=...)."
        )
    return None


def candidates(device_count: int, tp_sizes: Iterable[int] | None = None) -> list[Strategy]:
    """The layouts ``device_count`` devices allow: ``DataParallel()``, ``FSDP()``, and for
    each tensor-parallel size (default: every divisor of ``device_count`` above 1)
    ``DataParallel`` and ``FSDP`` over the devices left, times ``TensorParallel`` (just
    ``TensorParallel(n)`` when it takes every device)."""
    sizes = range(2, device_count + 1) if tp_sizes is None else sorted(set(tp_sizes))
    found: list[Strategy] = [DataParallel(), FSDP()]
    for tp in sizes:
        if tp < 2 or device_count % tp:
            continue
        rest = device_count // tp
        if rest == 1:
            found.append(TensorParallel(tp))
        else:
            found.append(Hybrid(DataParallel(rest), TensorParallel(tp)))
            found.append(Hybrid(FSDP(rest), TensorParallel(tp)))
    return found


def _layer_axes(strategy: Strategy) -> tuple[str, ...]:
    """The mesh axes a strategy splits layers over: its ``TensorParallel`` members' axes."""
    members = strategy.members if isinstance(strategy, Hybrid) else (strategy,)
    return tuple(m.axis for m in members if isinstance(m, TensorParallel))


def _axes_used(plan: Plan) -> set[str]:
    """The mesh axes some state leaf's spec splits a dimension over."""
    used: set[str] = set()
    for sharding in plan.leaf_shardings:
        for entry in sharding.spec:
            used.update(entry if isinstance(entry, tuple) else (entry,) if entry else ())
    return used


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _bytes_or_reason(row: Candidate) -> str:
    if row.peak_bytes is None:
        return f"cannot split: {row.reason}"
    return f"a peak of {size(row.peak_bytes)} ({row.peak_bytes} bytes)"


class _Timed:
    """A candidate that fits: its row, plan, compiled step and batch placement."""

    def __init__(self, row: Candidate, plan: Plan, compiled: Any, placement: Placement) -> None:
        self.row, self.plan, self.compiled, self.placement = row, plan, compiled, placement

    def run(self, batches: Sequence[Any], time_steps: TimeSteps) -> float:
        """Seconds per step over the host ``batches``, placed here and timed by
        ``time_steps`` from a fresh state; the placed batches deleted after."""
        placed = [self.placement.place(b, divisor=self.plan.grad_accum_steps) for b in batches]
        try:
            return time_steps(self.plan, self.compiled, placed)
        finally:
            delete_arrays(placed)


def agreed_text(text: str | None) -> str | None:
    """Process 0's ``text`` on every process: a choice all processes must make alike."""
    return agree.broadcast_from_first("auto: the layout to resume", text) or None


def _plan_candidates(
    strategies: Sequence[Strategy],
    *,
    model: ModelFactory,
    optimizer: optax.GradientTransformation,
    first_batch: Any,
    loss_fn: Any,
    memory_budget_bytes: int | None,
    devices: Sequence[jax.Device],
    lower: Lower,
    data_shard: DataShard | None,
    plan_kwargs: dict[str, Any],
) -> tuple[list[Candidate], list[_Timed], int | None]:
    """Each strategy planned and its step compiled from shapes: (a row for each, the
    candidates that fit, the per-device budget they were checked against)."""
    rows: list[Candidate] = []
    timed: list[_Timed] = []
    budget = memory_budget_bytes
    for strategy in strategies:
        row = Candidate(strategy)
        rows.append(row)
        try:
            plan = Plan(
                model, optimizer, strategy=strategy, loss_fn=loss_fn, devices=devices, **plan_kwargs
            )
            row.mesh = {str(k): int(v) for k, v in plan.mesh.shape.items()}
            unused = [a for a in _layer_axes(strategy) if a not in _axes_used(plan)]
            if unused:
                row.reason = f"no dimension of the model is annotated for the {unused[0]!r} axis"
                continue
            if jax.process_count() > 1:
                data_shard = data_shard or plan.data_shard
                if plan.data_shard != data_shard:
                    row.reason = f"its processes feed {plan.data_shard}, the data is {data_shard}"
                    continue
            placement = Placement(plan, prefetch=0)
            first = placement.place(first_batch, divisor=plan.grad_accum_steps)
            shapes = abstract_batch(first)
            delete_arrays(first)
            compiled = lower(plan, shapes).compile()
        except (ShardingError, ValueError) as error:
            row.reason = _first_line(error)
            continue
        report = plan_report.build(plan, compiled, memory_budget_bytes=memory_budget_bytes)
        budget = report.budget_bytes
        row.report, row.peak_bytes = report, report.memory["peak"]
        row.state_bytes = sum(r["bytes_per_device"] for r in report.leaves)
        if report.fits is False:
            row.status = "does not fit"
            row.reason = f"a peak of {size(row.peak_bytes)} > {size(budget or 0)}"
            continue
        timed.append(_Timed(row, plan, compiled, placement))
    return rows, timed, budget


def choose(
    model: ModelFactory,
    optimizer: optax.GradientTransformation,
    batches: Iterable[Any],
    *,
    loss_fn: Any = None,
    memory_budget_bytes: int | None = None,
    devices: Sequence[jax.Device] | None = None,
    strategies: Sequence[Strategy] | None = None,
    steps: int = 3,
    rounds: int = 3,
    lower: Lower | None = None,
    data_shard: DataShard | None = None,
    resume: str | None = None,
    time_steps: TimeSteps | None = None,
    **plan_kwargs: Any,
) -> Choice:
    """Plans every candidate layout, times those that fit, and returns the fastest.

    Args:
      model: a factory ``rngs -> nnx.Module`` (each timing builds a fresh state).
      optimizer, loss_fn, devices, **plan_kwargs: as for ``Plan``.
      batches: this process's host batches; the first ``steps`` are used (repeated
        when there are fewer).
      memory_budget_bytes: per device (default the device's limit where reported).
      strategies: the candidates (default ``candidates(len(devices))``, and
        ``strategies.expert.expert_candidates`` for a model with experts).
      steps, rounds: see ``Auto``.
      lower: how a candidate's train step is lowered (default ``plan.lower(shapes)``);
        ``Trainer`` lowers its own ``train_step``.
      data_shard: the rows this process's batches are (multi-process runs); a
        candidate whose processes would feed other rows cannot take them. Default:
        the first candidate's.
      resume: the layout (a strategy's ``repr``) of the run about to be resumed. The
        candidate that is it is taken without timing anything when it still fits, so
        a resumed run goes on in the layout it ran in; otherwise all are timed.
      time_steps: how a candidate that fits is timed (``TimeSteps``): the engine's
        ``engine.timing.time_steps``, which ``Trainer`` hands. Needed once a candidate
        is to be timed.

    Raises:
      NoLayoutFits: no candidate fits; the message lists every candidate's bytes.
      TypeError: a candidate is to be timed and no ``time_steps`` was given.
    """
    if isinstance(model, nnx.Module) or not callable(model):
        raise TypeError(
            "strategy='auto' builds the state once per timed layout, so it needs a model "
            "factory: model=lambda rngs: MyModel(..., rngs=rngs), not a built module."
        )
    taken = list(itertools.islice(iter(batches), steps))
    if not taken:
        raise ValueError("strategy='auto' needs batches to time the layouts on; none came.")
    timing_batches = list(itertools.islice(itertools.cycle(taken), steps))
    devices = list(jax.devices() if devices is None else devices)
    if strategies is None:  # a model with experts: the expert layouts too
        experts = expert.num_experts(model)
        strategies = candidates(len(devices)) + expert.expert_candidates(len(devices), experts)
    lower = lower or (lambda plan, shapes: plan.lower(shapes))
    plan_all = functools.partial(
        _plan_candidates,
        model=model,
        optimizer=optimizer,
        first_batch=taken[0],
        loss_fn=loss_fn,
        memory_budget_bytes=memory_budget_bytes,
        devices=devices,
        lower=lower,
        data_shard=data_shard,
        plan_kwargs=plan_kwargs,
    )
    same = [s for s in strategies if resume is not None and repr(s) == resume][:1]
    if same:  # the resumed run's layout, taken untimed where it still fits
        rows, timed, budget = plan_all(same)
        if timed:
            rows[0].status, rows[0].reason = "resumed", "the layout of the run being resumed"
            return Choice(timed[0].plan, rows, budget, steps, rounds, resumed=True)
    rows, timed, budget = plan_all(strategies)
    if not timed:
        raise _nothing_fits(rows, budget)
    medians = _median_step_times(timed, timing_batches, rounds, time_steps)
    winner = _rank(rows, timed, medians)
    return Choice(plan=winner, rows=rows, budget_bytes=budget, steps=steps, rounds=rounds)


def _nothing_fits(rows: list[Candidate], budget: int | None) -> NoLayoutFits:
    listing = "\n".join(f"  {r.layout}: {_bytes_or_reason(r)}" for r in rows)
    budget_text = f"{size(budget)} ({budget} bytes)" if budget is not None else "unknown"
    return NoLayoutFits(
        f"strategy='auto': no layout fits the memory budget of {budget_text} per device. "
        f"The candidates, per device:\n{listing}\nGive more devices or memory, a smaller "
        "batch, or gradient accumulation (grad_accum_steps)."
    )


def _median_step_times(
    timed: list[_Timed], batches: list[Any], rounds: int, time_steps: TimeSteps | None
) -> list[float]:
    """Each candidate timed ``rounds`` times taking turns (after a round untimed: first
    calls, caches); the median of each one's rounds, process 0's on every process."""
    if time_steps is None:
        raise TypeError(
            "auto.choose times the layouts that fit by training on them, which is the "
            "engine's: pass time_steps=nnx_spmd_trainer.engine.timing.time_steps "
            "(Trainer(strategy='auto') does)."
        )
    for _ in range(rounds + 1):
        for candidate in timed:
            candidate.row.times.append(candidate.run(batches, time_steps))
    medians = [statistics.median(c.row.times[1:]) for c in timed]
    return [float(t) for t in agree.broadcast_from_first("auto: step times", medians)]


def _rank(rows: list[Candidate], timed: list[_Timed], medians: list[float]) -> Plan:
    """Sorts ``rows``: the timed fastest first, then those that do not fit (smallest
    peak first), then those that cannot split; returns the fastest's plan."""
    best = min(medians)
    for candidate, median in zip(timed, medians, strict=True):
        candidate.row.status, candidate.row.step_time_s = "timed", median
        candidate.row.ratio = median / best if best > 0 else 1.0
    order = {"timed": 0, "does not fit": 1, "cannot split": 2}
    rows.sort(key=lambda r: (order[r.status], r.step_time_s or 0.0, r.peak_bytes or 0))
    return next(c.plan for c in timed if c.row is rows[0])


def choose_on(
    train_data: Iterable[Any], steps: int, choose_layout: Callable[[Iterable[Any]], Choice]
) -> Iterable[Any]:
    """``choose_layout`` on the first ``steps`` batches; the data with every batch still
    in it (``data.position.look_ahead``)."""
    return look_ahead(train_data, steps, choose_layout)
