"""Run: the one owner of a training run's mutable state, and its ``RunState`` snapshots.

The loop reads and writes the run only through a ``Run``; a checkpoint
callback asks for a ``snapshot()`` and gives one back to ``load()``. No other
object holds a piece of what a ``RunState`` records (the compiled steps are the plan's,
``plan.steps``; the loop keeps only what it read of them and the last host batch,
which no resumed run needs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import numpy as np
from flax import nnx

from nnx_spmd_trainer import deprecation
from nnx_spmd_trainer.data.position import DataPosition, has_position
from nnx_spmd_trainer.engine.hooks import CallbackList
from nnx_spmd_trainer.engine.metric_log import LogSchedule, MetricLog, StepPerf
from nnx_spmd_trainer.engine.run_state import Progress, RunState
from nnx_spmd_trainer.engine.step_record import StepRecord
from nnx_spmd_trainer.planner.auto import LayoutNotChosen as LayoutNotChosen
from nnx_spmd_trainer.planner.auto import not_chosen
from nnx_spmd_trainer.planner.plan import Plan
from nnx_spmd_trainer.planner.state import LiveState


class Run:
    """Every mutable piece of one trainer's run, in one place.

    Attributes:
      plan: the layout the state lives in; ``None`` with ``strategy="auto"`` until
        the layout is chosen. Setting it gives the run a ``metric_log`` for it.
      metric_log: the plan's on-device metric accumulators and last norms (``MetricLog``);
        ``LayoutNotChosen`` while there is no plan.
      schedule: when training metrics leave the devices (``LogSchedule``, a trainer
        setting, whatever the plan).
      timings: where the host's time went, over the run (``StepPerf``: goodput).
      last_step: the last training step (``StepRecord``: step, loss on device, batch
        shapes, timings), the one the callbacks were handed; ``None`` before the first.
      progress: the epoch, the batches taken of it, the epoch's iterator and the
        position of its next batch, preemption, the first non-finite step (``Progress``).
      live: the live model and optimizer (``LiveState``), once built (``objects()``).
      initial_state: what builds the first state from the plan instead of its random
        initialiser (``Trainer(init_from=...)``); never called when a state is loaded first.
      host_step: a host copy of the optimizer's count; ``None``: ``step`` reads it
        from the devices (after the state was assigned, or an override's first step).
      stop_requested: ``fit`` ends after the current step.
      start: where the next ``fit`` begins (epoch, batches taken, data position) after
        ``load``; ``None``: at the start of epoch 0.
      callbacks: the callbacks whose states a snapshot holds.
    """

    def __init__(self, schedule: LogSchedule | None = None) -> None:
        self._plan: Plan | None = None
        self._metric_log: MetricLog | None = None
        self.schedule: LogSchedule = schedule if schedule is not None else LogSchedule()
        self.timings: StepPerf = StepPerf()
        self.last_step: StepRecord | None = None
        self.progress = Progress()
        self.live: LiveState | None = None  # built when first needed
        self.initial_state: Callable[[Plan], nnx.State] | None = None
        self.host_step: int | None = 0
        self.stop_requested = False
        self.start: DataPosition | None = None
        self.callbacks: CallbackList | None = None
        self._resume_point: RunState | None = None  # the run before fit's final logs

    report = deprecation.renamed_property(
        "Run.report",
        "run.metric_log",
        lambda run: run.metric_log,
        lambda run, value: setattr(run, "metric_log", value),
    )

    @property
    def plan(self) -> Plan | None:
        return self._plan

    @plan.setter
    def plan(self, plan: Plan | None) -> None:
        """A new plan comes with empty accumulators of its own (its metrics, its mesh)."""
        if plan is not self._plan:
            self._metric_log = None if plan is None else MetricLog(plan.empty_metrics, run=self)
        self._plan = plan

    @property
    def metric_log(self) -> MetricLog:
        """The plan's ``MetricLog``; ``LayoutNotChosen`` while there is no plan."""
        if self._metric_log is None:
            raise not_chosen("metric_log")
        return self._metric_log

    @metric_log.setter
    def metric_log(self, metric_log: MetricLog) -> None:
        self._metric_log = metric_log

    def chosen_plan(self, asked: str) -> Plan:
        """The plan; ``LayoutNotChosen`` naming ``trainer.<asked>`` (what the caller
        asked for) while ``strategy="auto"`` has not chosen."""
        if self.plan is None:
            raise not_chosen(asked)
        return self.plan

    def layout(self) -> Plan:
        """Deprecated: ``chosen_plan`` (it returns the plan, not a layout)."""
        deprecation.warn_renamed("Run.layout()", "Run.chosen_plan(asked)")
        return self.chosen_plan("plan")

    # -- the state: one authority, the live objects ----------------------------------
    def objects(self, asked: str = "state") -> LiveState:
        """The live objects, built the first time from ``initial_state`` (pretrained
        weights), else from the plan's initialiser (``asked``: what an error names)."""
        if self.live is None:
            plan = self.chosen_plan(asked)
            state = plan.materialize() if self.initial_state is None else self.initial_state(plan)
            self.live = LiveState(nnx.merge(plan.graphdef, state))
        return self.live

    def set_state(self, state: nnx.State) -> None:
        """Places ``state`` with the plan's shardings into the live objects (built from
        it when they were not yet: the initial state is then never built)."""
        plan = self.chosen_plan("state")
        try:
            placed = jax.device_put(state, plan.shardings)
        except ValueError as error:
            raise ValueError(
                "The assigned state does not have the trainer's structure "
                f"({error}). Assign a state saved from a trainer built with the same model "
                "and optimizer (trainer.state)."
            ) from error
        if self.live is None:
            self.live = LiveState(nnx.merge(plan.graphdef, placed))
        else:
            nnx.update(self.live.objects, placed)
            self.live.refresh()
        self.host_step = None  # the optimizer count came with the state

    @property
    def step(self) -> int:
        """The global step: the optimizer's update count (a host copy; see ``host_step``)."""
        if self.host_step is None:
            count = self.objects().objects["optimizer"].step.get_raw_value()
            self.host_step = int(np.asarray(count.addressable_data(0)))
        return self.host_step

    @step.setter
    def step(self, value: int) -> None:
        counter = self.objects().objects["optimizer"].step
        current = counter.get_raw_value()
        counter.set_raw_value(jax.device_put(np.asarray(value, current.dtype), current.sharding))
        self.host_step = int(value)

    # -- a fit's beginning and end, and stopping ------------------------------------------
    def begin_fit(self, max_steps: int | None, eval_every_n_steps: int | None) -> None:
        self.stop_requested = False
        self.progress.preempted, self.progress.nonfinite_step = False, None
        self.progress.max_steps = max_steps
        self.progress.eval_every_n_steps = eval_every_n_steps
        self._resume_point = None
        if self.live is not None:
            self.live.refresh()  # the user may have changed the model between fits

    def end_fit(self) -> None:
        self.progress.eval_every_n_steps = None
        self.start = None  # a resume point is for the next fit only

    def request_stop(self, *, preempted: bool = False, nonfinite_step: int | None = None) -> None:
        """``fit`` ends after the current step (see ``Trainer.request_stop``)."""
        self.stop_requested = True
        self.progress.preempted |= preempted
        if nonfinite_step is not None and self.progress.nonfinite_step is None:
            self.progress.nonfinite_step = nonfinite_step

    def done(self, max_steps: int | None) -> bool:
        return self.stop_requested or (max_steps is not None and self.step >= max_steps)

    def hold_resume_point(self, *, keep: bool = False) -> None:
        """From here, ``snapshot`` is the run as it is now: what a resumed run starts
        from, before ``fit``'s final logs (``keep``: unless one is already held)."""
        if not (keep and self._resume_point is not None):
            self._resume_point = self._now()

    # -- snapshots: what a checkpoint saves and restores ----------------------------------
    def snapshot(self, *, abstract: bool = False) -> RunState:
        """The run as ``Trainer.run_state`` describes it (``abstract``: restore targets)."""
        run = self._resume_point or self._now()
        if not abstract:
            return dataclasses.replace(run, state=self.objects().as_state())
        plan = self.chosen_plan("run_state")
        metrics = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
            run.train_metrics,
        )
        return dataclasses.replace(run, state=plan.state_targets(), train_metrics=metrics)

    def _now(self) -> RunState:
        """Everything of the run state but the state itself (``state=None``)."""
        assert self.callbacks is not None
        position = self.progress.position()
        return RunState(
            state=None,
            train_metrics=self.metric_log.train,
            step=self.step,
            epoch=self.progress.epoch,
            batches_in_epoch=self.progress.batches_in_epoch,
            train_metric_steps=self.metric_log.train_steps,
            # Containers copied (leaves shared): later hooks do not edit this record.
            callbacks=jax.tree.map(lambda x: x, self.callbacks.state_dict()),
            data=position.get_state() if has_position(position) else None,
        )

    def load(self, run: RunState) -> None:
        """Puts a saved run back (see ``Trainer.load_run_state``)."""
        assert self.callbacks is not None
        self._resume_point = None
        self.set_state(run.state)
        replicated = self.chosen_plan("load_run_state").replicated
        self.metric_log.train = jax.device_put(run.train_metrics, replicated)
        self.metric_log.train_steps = int(run.train_metric_steps)
        self.callbacks.load_state_dict(dict(run.callbacks))
        self.start = DataPosition(int(run.epoch), int(run.batches_in_epoch), run.data)
