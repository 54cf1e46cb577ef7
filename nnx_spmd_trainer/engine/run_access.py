"""RunAccess: the ``Trainer``'s members that read and write its ``Run``.

The live model, optimizer and state, the step, the last step's record, the run state
a checkpoint saves and restores, the metric log and its schedule, the progress and the
stop request: each is the
``Run``'s (``trainer.run``), reached through the trainer under the names
callbacks and users know.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flax import nnx

from nnx_spmd_trainer import deprecation
from nnx_spmd_trainer.engine.metric_log import LogSchedule, MetricLog
from nnx_spmd_trainer.engine.run_state import Progress, RunState
from nnx_spmd_trainer.engine.step_record import StepRecord

if TYPE_CHECKING:
    from nnx_spmd_trainer.engine.run import Run


class RunAccess:
    """The run's state, through the trainer (a mixin of ``Trainer``; everything here is
    ``self.run``'s)."""

    if TYPE_CHECKING:  # the Trainer's; not an annotation of the documented class
        run: Run

    @property
    def metric_log(self) -> MetricLog:
        """The plan's on-device metric accumulators (``MetricLog``); with
        ``strategy="auto"``, ``LayoutNotChosen`` until the layout is chosen."""
        return self.run.metric_log

    @property
    def log_schedule(self) -> LogSchedule:
        """When training metrics reach ``logs`` (``LogSchedule``: ``request_log_every(n)``,
        ``track_norms``): a setting of the trainer, whatever its layout."""
        return self.run.schedule

    @property
    def last_step(self) -> StepRecord | None:
        """The last training step (``StepRecord``: ``step``, ``loss`` still on the
        devices, ``batch_shapes``, host timings); ``None`` before the first. Each callback
        is handed the same record as ``self.step_record``; keeping it or its loss costs
        no device sync."""
        return self.run.last_step

    report = deprecation.renamed_property(
        "Trainer.report", "trainer.metric_log", lambda trainer: trainer.metric_log
    )

    @property
    def progress(self) -> Progress:
        """Where the running (or last) ``fit`` is (``Progress``, the run's)."""
        return self.run.progress

    # -- the state: the run's live objects ----------------------------------------------
    @property
    def model(self) -> nnx.Module:
        """The live ``nnx.Module``; its parameters are sharded on ``self.mesh``.

        It is current after every step: each step writes its results into the
        same Variables, and the next step donates their arrays, so read values
        again in each hook rather than keeping arrays. Edits to it (``set_value``)
        are what the next step trains. The steps set train/eval mode on their
        own copy; this object's mode is yours.
        """
        return self.run.objects("model").objects["model"]

    @property
    def optimizer(self) -> nnx.Optimizer[nnx.Module]:
        """The live ``nnx.Optimizer``; its state is sharded like the parameters (see ``model``)."""
        return self.run.objects("optimizer").objects["optimizer"]

    @property
    def state(self) -> nnx.State:
        """``{"model": ..., "optimizer": ...}`` as one ``nnx.State``: what a checkpoint saves.

        A snapshot with its own Variables, holding this step's arrays; the next
        step donates those arrays, so copy what you keep
        (``jax.tree.map(jnp.copy, trainer.state)`` on device, or ``jax.device_get``).
        Assigning ``trainer.state = saved`` places ``saved`` with the strategy's
        shardings into the live objects (``trainer.step`` follows its optimizer
        step) and hands its arrays to the next step; before the state was built,
        it is never built.
        """
        return self.run.objects().as_state()

    @state.setter
    def state(self, state: nnx.State) -> None:
        self.run.set_state(state)

    @property
    def step(self) -> int:
        """The global step: the optimizer's update count, read from the state.

        A host copy follows each step without a device sync; it is re-read from
        the devices after ``state`` was assigned and after a step whose count
        is not the one before plus one (a ``train_step`` that updates twice).
        """
        return self.run.step

    @step.setter
    def step(self, value: int) -> None:
        self.run.step = value

    # -- the run state: what a checkpoint saves and restores ----------------------------
    def run_state(self, *, abstract: bool = False) -> RunState:
        """The run as it is now: state, metric accumulators, step, epoch and position
        in it, the data position and every callback's state (``RunState``; the ``Run``'s
        snapshot).

        After a ``fit`` that ended between log points, it is the run as it was before
        that fit's final logs (the end-of-fit evaluation and the partial average
        of the metrics): a run resumed from it logs what an uninterrupted run logs.

        With ``abstract``, the arrays are ``jax.ShapeDtypeStruct`` targets laid out
        as this trainer lays them out: restore into them and ``load_run_state`` the
        result, and no array of the initial state is ever built.
        """
        return self.run.snapshot(abstract=abstract)

    def load_run_state(self, run: RunState) -> None:
        """Puts a saved run back: the next ``fit`` goes on exactly where it stopped.

        The state is placed with this trainer's shardings (from any layout), the
        metric accumulators and callback states are set, and the next ``fit``
        starts in ``run.epoch`` after its first ``run.batches_in_epoch`` batches:
        the epoch's iterator is set to ``run.data`` (a ``get_state()`` value), or,
        without one, that many batches are read and discarded, with a warning.
        """
        self.run.load(run)

    @property
    def stop_requested(self) -> bool:
        """Whether ``fit`` ends after the current step (``request_stop`` was called)."""
        return self.run.stop_requested

    stop_training = deprecation.renamed_property(
        "Trainer.stop_training",
        "trainer.request_stop() to stop, trainer.stop_requested to read",
        lambda trainer: trainer.stop_requested,
        lambda trainer, stop: trainer.request_stop() if stop else None,
    )

    def request_stop(self, *, preempted: bool = False, nonfinite_step: int | None = None) -> None:
        """Ends ``fit`` after the current step (what a callback asks instead of writing
        the trainer's fields). ``preempted``: a checkpoint was saved for a preemption
        (``fit`` then ends without its final evaluation). ``nonfinite_step``: the first
        step whose loss was not finite; no checkpoint saves from it on."""
        self.run.request_stop(preempted=preempted, nonfinite_step=nonfinite_step)
