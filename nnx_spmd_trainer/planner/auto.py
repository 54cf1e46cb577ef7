"""``strategy="auto"``: plan every layout the devices allow, time those that fit, take the fastest.

Each candidate is planned from shapes alone (``Plan`` and its compiled train
step: ``PlanReport``), so one that does not fit the per-device memory never
has its state built. The candidates that fit are timed on real batches, a
few steps each, taking turns round after round (the median of the rounds),
with only one candidate's state on the devices at a time (each step taken as
the trainer's loop takes it: ``loop.train_one``) and every array of a timing
deleted after it: what stays is the chosen ``Plan``, whose state is
then built afresh (the initial state, as if the layout had been given).

>>> candidates(8, tp_sizes=[2])  # doctest: +NORMALIZE_WHITESPACE
[DataParallel(), FSDP(), Hybrid(DataParallel(4), TensorParallel(2)),
 Hybrid(FSDP(4), TensorParallel(2))]
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from nnx_spmd_trainer import deprecation
from nnx_spmd_trainer.data.placement import InFlight, Placement
from nnx_spmd_trainer.data.position import has_position
from nnx_spmd_trainer.data_shard import DataShard
from nnx_spmd_trainer.engine.loop import train_one
from nnx_spmd_trainer.engine.metric_log import MetricLog
from nnx_spmd_trainer.engine.run import (
    LayoutNotChosen as LayoutNotChosen,  # its public home was here
)
from nnx_spmd_trainer.engine.run import Run
from nnx_spmd_trainer.engine.run import not_chosen as not_chosen
from nnx_spmd_trainer.planner import plan_report
from nnx_spmd_trainer.planner.plan import Plan, abstract_batch
from nnx_spmd_trainer.planner.plan_report import PlanReport, size
from nnx_spmd_trainer.planner.state import ModelFactory
from nnx_spmd_trainer.sharding import ShardingError
from nnx_spmd_trainer.strategies import FSDP, DataParallel, Hybrid, Strategy, TensorParallel, expert

#: How a candidate's train step is lowered: ``(plan, global batch shapes) -> Lowered``.
Lower = Callable[[Plan, Any], jax.stages.Lowered]


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
        mesh = " x ".join(f"{k}={v}" for k, v in self.mesh.items()) or "-"
        state = size(self.state_bytes) if self.state_bytes is not None else "-"
        peak = size(self.peak_bytes) if self.peak_bytes is not None else "-"
        if self.step_time_s is None:
            return [self.layout, mesh, state, peak, f"{self.status}: {self.reason}", ""]
        time_text, ratio = f"{self.step_time_s * 1e3:.3f} ms", f"{self.ratio or 1.0:.2f}x"
        return [self.layout, mesh, state, peak, time_text, ratio]


HEADER = ["layout", "mesh", "state/device", "peak/device", "step time", "vs best"]


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
        budget = f"{size(self.budget_bytes)} per device" if self.budget_bytes else "no memory limit"
        if self.resumed:
            return (
                f'strategy="auto" kept {self.chosen.layout}, the resumed run\'s layout ({budget})'
            )
        return (
            f'strategy="auto" chose {self.chosen.layout} ({budget}; {self.steps} steps x '
            f"{self.rounds} rounds, median)"
        )

    def table(self) -> str:
        """The ranking as aligned text: what ``Trainer`` prints at the start of the run."""
        lines = [HEADER, *(row.cells() for row in self.rows)]
        widths = [max(len(line[i]) for line in lines) for i in range(len(HEADER))]
        text = [self.title()]
        for at, line in enumerate(lines):
            mark = "  <- chosen" if at == 1 else ""
            cells = "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True))
            text.append(f"  {cells.rstrip()}{mark}")
        return "\n".join(text)

    def markdown(self) -> str:
        """The ranking as a Markdown table (TensorBoard's text tab)."""
        rows = [HEADER, ["---"] * len(HEADER), *(row.cells() for row in self.rows)]
        body = "\n".join("| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows)
        return f"{self.title()}\n\n{body}"

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


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _bytes_or_reason(row: Candidate) -> str:
    if row.peak_bytes is None:
        return f"cannot split: {row.reason}"
    return f"a peak of {size(row.peak_bytes)} ({row.peak_bytes} bytes)"


def _delete(tree: Any) -> None:
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array) and not leaf.is_deleted():
            leaf.delete()


class _Timed:
    """A candidate that fits: its plan, compiled step and batch placement."""

    def __init__(self, row: Candidate, plan: Plan, compiled: Any, placement: Placement) -> None:
        self.row, self.plan, self.compiled, self.placement = row, plan, compiled, placement

    def run(self, batches: Sequence[Any], in_flight: int = 2) -> float:
        """Seconds per step over ``batches`` from a fresh state, each step taken as ``fit``
        takes it (``loop.train_one`` on a ``Run`` of the candidate's, ``in_flight`` steps
        unfinished at most), then every array of the run deleted."""
        placed = [self.placement.place(b, divisor=self.plan.grad_accum_steps) for b in batches]
        plan = self.plan
        run = Run(MetricLog(plan.empty_metrics, plan.mesh.local_devices, track_norms=False))
        run.plan = plan
        bound = InFlight(in_flight)
        try:
            with jax.set_mesh(plan.mesh):
                jax.block_until_ready((run.objects().arrays(), run.metric_log.train, placed))
                start = time.perf_counter()
                for batch in placed:
                    train_one(run, self.compiled, batch, bound)
                bound.drain()
                jax.block_until_ready((run.objects().arrays(), run.metric_log.train))
                return (time.perf_counter() - start) / len(placed)
        finally:
            bound.clear()
            log = run.metric_log
            arrays = run.live.arrays() if run.live is not None else []
            _delete((arrays, log.train, log.eval, log.last_loss, log.perf.norms, placed))


def _agreed(times: list[float]) -> list[float]:
    """Process 0's times on every process: all must choose the same layout."""
    if jax.process_count() == 1:
        return times
    from jax.experimental import multihost_utils

    return [float(t) for t in multihost_utils.broadcast_one_to_all(np.asarray(times))]


def agreed_text(text: str | None) -> str | None:
    """Process 0's ``text`` on every process: a choice all processes must make alike."""
    if jax.process_count() == 1:
        return text
    from jax.experimental import multihost_utils

    encoded = np.frombuffer((text if text is not None else "").encode(), np.uint8)
    length = int(multihost_utils.broadcast_one_to_all(np.int32(len(encoded))))
    padded = np.zeros(max(length, 1), np.uint8)
    padded[: min(length, len(encoded))] = encoded[:length]
    agreed = bytes(np.asarray(multihost_utils.broadcast_one_to_all(padded))[:length]).decode()
    return agreed or None


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
            _delete(first)
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

    Raises:
      NoLayoutFits: no candidate fits; the message lists every candidate's bytes.
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
        listing = "\n".join(f"  {r.layout}: {_bytes_or_reason(r)}" for r in rows)
        budget_text = f"{size(budget)} ({budget} bytes)" if budget is not None else "unknown"
        raise NoLayoutFits(
            f"strategy='auto': no layout fits the memory budget of {budget_text} per device. "
            f"The candidates, per device:\n{listing}\nGive more devices or memory, a smaller "
            "batch, or gradient accumulation (grad_accum_steps)."
        )
    for _ in range(rounds + 1):  # the first round untimed: first calls, caches
        for candidate in timed:
            candidate.row.times.append(candidate.run(timing_batches))
    medians = _agreed([statistics.median(c.row.times[1:]) for c in timed])
    best = min(medians)
    for candidate, median in zip(timed, medians, strict=True):
        candidate.row.status, candidate.row.step_time_s = "timed", median
        candidate.row.ratio = median / best if best > 0 else 1.0
    order = {"timed": 0, "does not fit": 1, "cannot split": 2}
    rows.sort(key=lambda r: (order[r.status], r.step_time_s or 0.0, r.peak_bytes or 0))
    winner = next(c.plan for c in timed if c.row is rows[0])
    return Choice(plan=winner, rows=rows, budget_bytes=budget, steps=steps, rounds=rounds)


def choose_on(
    train_data: Iterable[Any], steps: int, choose_layout: Callable[[Iterable[Any]], Choice]
) -> Iterable[Any]:
    """Calls ``choose_layout`` with the first ``steps`` batches of ``train_data``; returns
    data that still yields every batch: a re-iterable is iterated afresh, a Grain
    iterator set back where it was, a one-shot iterator's batches put back in front."""
    iterator = iter(train_data)
    if iterator is not train_data:  # re-iterable: fit starts a pass of its own
        choose_layout(itertools.islice(iterator, steps))
        return train_data
    if has_position(iterator):  # a Grain iterator: set back where it was
        positioned: Any = iterator
        position = positioned.get_state()
        choose_layout(list(itertools.islice(iterator, steps)))
        positioned.set_state(position)
        return train_data
    taken = list(itertools.islice(iterator, steps))
    choose_layout(taken)
    return itertools.chain(taken, iterator)
