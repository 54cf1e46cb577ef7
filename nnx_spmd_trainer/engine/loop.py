"""Loop: the order things happen in ``fit``, ``evaluate`` and ``predict``, apart from the Trainer.

Epochs, batches, one train step, evaluation, prediction and the exception path. The loop
reads and writes the run only through the ``Run``; of the ``Trainer`` it asks
the user's overrides (``train_step``, ``eval_fn``, ``predict_fn``), the
callbacks, and the layout (``plan``, ``placement``). One train step on a ``Run``
(``train_one``, ``take_step``) is also how ``strategy="auto"`` times its candidates.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import jax
from flax import nnx

from nnx_spmd_trainer.data import position as data_position
from nnx_spmd_trainer.data.batch_errors import batch_mismatch, raise_if_changed
from nnx_spmd_trainer.data.position import has_position
from nnx_spmd_trainer.data.prefetch import Prefetch
from nnx_spmd_trainer.engine import predict
from nnx_spmd_trainer.engine.hooks import Logs
from nnx_spmd_trainer.engine.step_record import BatchShapes, StepRecord
from nnx_spmd_trainer.planner import flops, forward

if TYPE_CHECKING:
    from nnx_spmd_trainer.data.placement import InFlight
    from nnx_spmd_trainer.engine.loop_host import LoopHost
    from nnx_spmd_trainer.engine.run import Run
    from nnx_spmd_trainer.planner.step_compiler import CachedStep

#: The trainer's method each kind of compiled step runs (``Loop.cached_step``).
_STEP_FUNCTIONS = {"train": "train_step", "eval": "eval_fn", "predict": "predict_fn"}

#: What a compiled train step returns: ``(state arrays, train metrics, loss, norms)``.
StepOutputs = tuple[list[jax.Array], Any, jax.Array, dict[str, jax.Array]]


def _any_deleted(leaves: Sequence[Any]) -> bool:
    return any(isinstance(x, jax.Array) and x.is_deleted() for x in leaves)


def take_step(run: Run, outputs: StepOutputs, in_flight: InFlight) -> jax.Array:
    """A dispatched train step's ``outputs`` taken into ``run`` as ``fit`` takes them: the
    new state written into the live objects, the metrics and norms kept, and the step
    joined to ``in_flight`` (which waits for the oldest step when more are unfinished
    than its bound). Returns the step's loss, still on the devices."""
    metric_log = run.metric_log
    arrays, metric_log.train, loss, metric_log.norms = outputs
    run.objects().write(arrays)
    in_flight.add(loss)
    metric_log.train_steps += 1
    return loss


def train_one(
    run: Run, step: Callable[..., StepOutputs], batch: Any, in_flight: InFlight
) -> jax.Array:
    """One compiled train ``step`` on ``run``'s live state and metrics, taken as ``fit``
    takes it (``take_step``): ``strategy="auto"`` times a candidate layout with it on a
    ``Run`` of its own, so a layout is timed as it trains. Returns the loss (on device)."""
    return take_step(run, step(run.objects().arrays(), run.metric_log.train, batch), in_flight)


class Loop:
    """Runs a trainer's epochs and evaluations on its ``Run``.

    It keeps only what the order of things needs between calls: how many updates each
    compiled train step of the running ``fit`` makes (an override's, read once), and the
    last host batch a step took (what a changed batch is compared with). After each
    step it hands the callbacks a ``StepRecord`` (``hand_record``; the run keeps the last
    as ``run.last_step``), and the placed batch to those that ask for it. When training
    metrics are logged is the run's ``LogSchedule``; where the time goes, its timings.
    """

    def __init__(self, trainer: LoopHost, *, overrides_train_step: bool) -> None:
        self.trainer = trainer
        self.run = trainer.run
        #: An overriding ``train_step`` may update any number of times (read once).
        self.overrides_train_step = overrides_train_step
        # Optimizer updates each compiled train step makes (an override's: read once per fit).
        self._updates_per_step: dict[Callable[..., Any], int] = {}
        self._last_host_batch: Any = None  # what a changed batch is compared with (BatchMismatch)
        self._last_eval_step = -1
        # FLOPs per device of each compiled train step, read once from its program.
        self._step_flops: dict[Callable[..., Any], float | None] = {}
        self._last_train_step: tuple[tuple[Any, ...], CachedStep] | None = None
        self._batch_shapes = BatchShapes()  # each step's, for its StepRecord
        self._tokens: int | None = None  # in the batch of shapes _tokens_of
        self._tokens_of: Any = None

    def compile(
        self, kind: str, batch: Any, *, norms: bool = False, fn: Callable[..., Any] | None = None
    ) -> Any:
        """The plan's compiled ``kind`` step ("train", "eval", "predict") for ``batch``,
        running the trainer's override of that kind, or ``fn`` where given."""
        return self.cached_step(kind, batch, norms=norms, fn=fn).fn

    def cached_step(
        self, kind: str, batch: Any, *, norms: bool = False, fn: Callable[..., Any] | None = None
    ) -> CachedStep:
        """``compile``'s step from the plan's cache, and whether this call compiled it."""
        trainer, live = self.trainer, self.run.objects()
        if fn is None:  # asked every step: one attribute read, no table of bound methods
            fn = getattr(trainer, _STEP_FUNCTIONS[kind])
        return trainer.plan.cached_step(
            kind,
            batch,
            fn=fn,
            norms=norms,
            graphdef=live.graphdef,
            treedef=live.treedef,
        )

    # -- fit -------------------------------------------------------------------------------
    def fit(
        self,
        train_data: Iterable[Any],
        eval_data: Iterable[Any] | None,
        max_steps: int | None,
        epochs: int | None,
        eval_every_n_steps: int | None,
        first_logs: Logs,
    ) -> None:
        """``Trainer.fit``'s epochs, once its arguments are checked and the layout chosen."""
        run, callbacks = self.run, self.trainer.callbacks
        run.begin_fit(max_steps, eval_every_n_steps)
        self._updates_per_step = {}  # an override's updates: read again in each fit
        self._last_eval_step = -1
        run.timings.restart()
        try:
            callbacks.on_fit_start({})  # may restore a run state (Run.load)
            callbacks.on_train_begin({})
            if first_logs:  # strategy="auto": the choice, in the run's first logs
                callbacks.on_logs(run.step, first_logs)
            if max_steps is not None and run.step >= max_steps:
                warnings.warn(
                    f"fit(max_steps={max_steps}) trains no step: the trainer is already at "
                    f"step {run.step}, and max_steps is the global step to stop at. Pass "
                    f"max_steps={run.step} + n to train n more steps.",
                    stacklevel=3,
                )
            self._epochs(train_data, eval_data, max_steps, epochs, eval_every_n_steps)
            self.trainer.placement.in_flight.drain()
            if run.progress.preempted:
                # The saved accumulators carry the steps since the last log point; a
                # partial average logged here would be a point the resumed run never has.
                callbacks.on_train_end({})
            else:
                # A run resumed from this step must not see this fit's final logs.
                run.hold_resume_point(keep=True)
                if eval_data is not None and self._last_eval_step != run.step:
                    self.evaluate(eval_data)
                callbacks.on_train_end(run.metric_log.flush(run.progress.epoch, run.timings))
            callbacks.on_fit_end({})
        except BaseException as error:
            self.abort(error)
            raise
        finally:
            run.end_fit()

    def _epochs(
        self,
        train_data: Iterable[Any],
        eval_data: Iterable[Any] | None,
        max_steps: int | None,
        epochs: int | None,
        eval_every_n_steps: int | None,
    ) -> None:
        run, callbacks = self.run, self.trainer.callbacks
        first = run.start.epoch if run.start else 0
        for epoch in itertools.count(first) if epochs is None else range(first, epochs):
            if run.done(max_steps):
                break
            run.progress.epoch = epoch
            callbacks.on_epoch_begin(epoch, {})
            if self._train_epoch(train_data, eval_data, max_steps, eval_every_n_steps) == 0:
                if epoch == first:
                    raise ValueError("train_data yielded no batches.")
                asked = f"epochs={epochs}" if epochs is not None else f"max_steps={max_steps}"
                warnings.warn(
                    f"train_data was exhausted at step {run.step}, in epoch {epoch} of "
                    f"{asked}: it is a one-shot iterator, so only {epoch} epoch(s) ran. "
                    "Pass a re-iterable dataset (a list, a grain.MapDataset) to run "
                    "several epochs.",
                    stacklevel=4,
                )
                break
            if run.progress.preempted:  # mid-epoch: the resumed run ends this epoch, not us
                break
            if run.done(max_steps):  # fit's final log point begins: a resumed run skips it
                run.hold_resume_point()
            self.trainer.placement.in_flight.drain()
            callbacks.on_epoch_end(epoch, run.metric_log.flush(epoch, run.timings))

    def abort(self, error: BaseException) -> None:
        """The exception path of ``fit``: settle the devices, tell the callbacks.

        Nothing here may raise over ``error``: a state left in a shape the
        trainer cannot read (a failed manual restore) must not hide it.
        """
        run, placement = self.run, self.trainer.placement
        with contextlib.suppress(Exception):  # a failed device step raises again here
            placement.in_flight.drain()
        placement.in_flight.clear()
        run.progress.train_iterator = None
        run.progress.read_ahead(None)
        if _any_deleted(jax.tree.leaves(run.metric_log.train)):
            run.metric_log.reset("train")  # donated to the failed step
        arrays: list[Any] = []
        with contextlib.suppress(Exception):
            arrays = run.live.arrays() if run.live else []
        if _any_deleted(arrays):
            error.add_note(
                f"nnx_spmd_trainer: the step after step {run.host_step} failed on the "
                "devices after its input state was donated, so that state is lost; restore "
                "a checkpoint (trainer.state = saved) before training on."
            )
        self.trainer.callbacks.on_exception(error)

    def _train_epoch(
        self,
        train_data: Iterable[Any],
        eval_data: Iterable[Any] | None,
        max_steps: int | None,
        eval_every_n_steps: int | None,
    ) -> int:
        """One pass over ``train_data`` (or until done); returns the batches of the epoch
        taken, those a resumed run had taken before included."""
        run, placement = self.run, self.trainer.placement
        run.progress.train_iterator = iterator = iter(train_data)
        run.progress.batches_in_epoch = 0
        if run.start is not None:
            run.progress.batches_in_epoch = data_position.seek(iterator, run.start)
            run.start = None
        # A one-shot iterator with no position cannot be set back after running ahead.
        ahead = placement.prefetch if iterator is not train_data or has_position(iterator) else 0
        divisor = self.trainer.plan.grad_accum_steps
        waiting = run.timings.waiting_for_data(placement.in_flight.running)
        batches = Prefetch(
            iterator,
            lambda b: placement.place(b, divisor=divisor),
            ahead,
            waiting=lambda: waiting,
            explain=lambda host, error: batch_mismatch(
                error, f"step {run.step + 1}", self._last_host_batch, host
            ),
        )
        run.progress.read_ahead(batches.position)
        try:
            with jax.set_mesh(self.trainer.plan.mesh):
                self._train_batches(batches, eval_data, max_steps, eval_every_n_steps)
        finally:
            batches.close()  # the iterator is left exactly after the last step's batch
            run.progress.read_ahead(None)  # train_iterator stays: a final checkpoint saves it
        return run.progress.batches_in_epoch

    def _train_batches(
        self,
        batches: Prefetch,
        eval_data: Iterable[Any] | None,
        max_steps: int | None,
        eval_every_n_steps: int | None,
    ) -> None:
        run, timings, callbacks = self.run, self.run.timings, self.trainer.callbacks
        schedule, seconds, progress = run.schedule, timings.seconds, run.progress
        stepping = timings.timing("step")  # one timer, entered once a step
        # Each record's timings are the parts' growth since the record before.
        waited, compiled, stepped = seconds["data_wait"], seconds["compile"], seconds["step"]
        # The host's work per step slows the devices' threads on a CPU backend (~10x its own
        # time: benchmarks/results/trainer_overhead.md): a per-step hook no callback
        # overrides is not called at all.
        begins = callbacks.overrides("on_train_batch_begin")
        ends = callbacks.overrides("on_train_batch_end")
        step_ends = callbacks.overrides("on_step_end")
        for host, batch in batches:
            progress.batches_in_epoch += 1
            # Hooks get the steps done so far at begin, and the new count at end.
            if begins:
                callbacks.on_train_batch_begin(run.step, {})
            with stepping:
                loss, shapes = self._train_one(batch, host, norms=schedule.norms_at(run.step + 1))
            step = run.step
            run.last_step = record = StepRecord(
                step,
                loss,
                shapes,
                data_wait_s=seconds["data_wait"] - waited,
                compile_s=seconds["compile"] - compiled,
                step_s=seconds["step"] - stepped,
            )
            waited, compiled, stepped = seconds["data_wait"], seconds["compile"], seconds["step"]
            callbacks.hand_record(record, batch)
            logs = (
                run.metric_log.flush(progress.epoch, timings) if schedule.is_log_step(step) else {}
            )
            if ends or logs:  # finished logs reach the writers (on_logs) in any case
                callbacks.on_train_batch_end(step, logs)
            if eval_every_n_steps and run.step % eval_every_n_steps == 0:
                assert eval_data is not None
                self.evaluate(eval_data)
                self._last_eval_step = run.step
            if step_ends:
                callbacks.on_step_end(run.step)
            if run.done(max_steps):
                break

    def _train_one(self, batch: Any, host: Any, *, norms: bool) -> tuple[jax.Array, Any]:
        """One train step on a placed ``batch``: its loss (on the devices) and the batch's
        shapes (the earlier step's object when they are the same, as in most steps)."""
        run, metric_log = self.run, self.run.metric_log
        batch = self.trainer.prepare_batch(batch)  # what the step trains on, and is planned on
        shapes = self._batch_shapes.of(batch)
        if shapes is not self._tokens_of:  # read again only when the shapes change
            self._tokens, self._tokens_of = flops.batch_tokens(shapes), shapes
        count = run.step  # before dispatch: afterwards the counter is a future array
        live = run.objects()
        try:
            step = self._train_step_for(batch, shapes, norms, live)
            args = (live.arrays(), metric_log.train, batch)
            arg_shapes = None if step.fn in self._step_flops else flops.abstract_args(args)
            if step.new:  # it traces and compiles in its first call (dispatch is asynchronous)
                with run.timings.timing("compile"):
                    outputs = step.fn(*args)
            else:
                outputs = step.fn(*args)
            if arg_shapes is not None:  # read from the program just compiled: a cache hit
                with run.timings.timing("compile"):
                    self._step_flops[step.fn] = flops.step_flops(
                        step.fn, arg_shapes, devices=self.trainer.plan.mesh.size
                    )
        except Exception as error:
            if not _any_deleted(live.arrays()):  # failed before it ran: tracing this batch
                raise_if_changed(error, f"step {count + 1}", self._last_host_batch, host)
            raise
        self._last_host_batch = host
        loss = take_step(run, outputs, self.trainer.placement.in_flight)
        run.timings.speed.add_step(tokens=self._tokens, flops=self._step_flops[step.fn])
        if self.overrides_train_step and step.fn not in self._updates_per_step:
            # An override may update any number of times: one read, in the first step of
            # each compiled step, says how many (the default updates once and reads nothing).
            run.host_step = None
            self._updates_per_step[step.fn] = run.step - count
        run.host_step = count + self._updates_per_step.get(step.fn, 1)
        return loss, shapes

    def _train_step_for(self, batch: Any, shapes: Any, norms: bool, live: Any) -> CachedStep:
        """``cached_step("train", ...)``, remembered for the next step while what its key
        reads is the same objects (shapes, graph, plan, the settings read at trace time):
        asked every step, the plan's lookup (a flatten, a key of the graph and the
        function) is then skipped."""
        plan = self.trainer.plan
        asked = (shapes, norms, live.graphdef, plan, plan.grad_accum_steps)
        last = self._last_train_step
        # By identity: equal but new objects (a graph re-read at a fit's start) compare
        # slowly (a graph field by field), so they miss once and are remembered instead.
        if last is not None and all(map(operator.is_, last[0], asked)):
            return last[1]
        step = self.cached_step("train", batch, norms=norms)
        self._last_train_step = (asked, step._replace(new=False))
        return step

    # -- evaluate --------------------------------------------------------------------------
    def evaluate(self, eval_data: Iterable[Any]) -> Logs:
        """``eval_fn`` over all of ``eval_data``: ``{"eval/loss": ..., ...}``."""
        with self.run.timings.timing("eval"):
            return self._evaluate(eval_data)

    def _evaluate(self, eval_data: Iterable[Any]) -> Logs:
        run, metric_log, callbacks = self.run, self.run.metric_log, self.trainer.callbacks
        placement = self.trainer.placement
        arrays = run.objects().arrays()
        metric_log.reset("eval")
        callbacks.on_test_begin({})
        batches = 0
        eval_step, structure = None, None
        previous = self._last_host_batch  # the first eval batch is compared with training's
        with jax.set_mesh(self.trainer.plan.mesh):
            for batches, host_batch in enumerate(eval_data, start=1):
                callbacks.on_test_batch_begin(batches, {})
                try:
                    batch = placement.place(placement.eval_batch(host_batch))
                    batch = self.trainer.prepare_batch(batch)
                    if eval_step is None or jax.tree.structure(batch) != structure:
                        eval_step = self.compile("eval", batch)
                        structure = jax.tree.structure(batch)
                    metric_log.eval = eval_step(arrays, metric_log.eval, batch)
                except Exception as error:
                    where = f"evaluation batch {batches} (after step {run.step})"
                    raise_if_changed(error, where, previous, host_batch)
                    raise
                previous = host_batch
                placement.in_flight.add(jax.tree.leaves(metric_log.eval)[0])
                callbacks.on_test_batch_end(batches, {})
        if batches == 0:
            raise ValueError("eval_data yielded no batches.")
        placement.in_flight.drain()
        logs = metric_log.compute("eval")
        callbacks.on_test_end(logs)
        return logs

    # -- predict ---------------------------------------------------------------------------
    def predict(
        self,
        batches: Iterable[Any],
        *,
        to_numpy: bool,
        predict_fn: Callable[..., Any] | None = None,
    ) -> list[Any]:
        """``predict_fn``'s outputs for each of ``batches`` (see ``Trainer.predict``): a
        forward-only program of the plan (``Plan.forward_program``) over the model's state."""
        trainer = self.trainer
        fn = trainer.predict_fn if predict_fn is None else predict_fn
        graphdef, state = nnx.split(self.run.objects().objects["model"])

        def run(batch: Any) -> Any:
            program = trainer.plan.forward_program(
                fn, graphdef, state, batch, out_shardings=forward.AS_COMPILED
            )
            return program(state, batch)

        with jax.set_mesh(trainer.plan.mesh):
            return predict.predict_batches(batches, trainer.placement, run, to_numpy=to_numpy)
