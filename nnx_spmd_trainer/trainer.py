"""Trainer: owns the mesh, the model and the optimizer; runs fit and evaluate."""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
from clu import metrics as clu_metrics
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_spmd_trainer import data, step
from nnx_spmd_trainer.callback import Callback, CallbackList, History, Logs
from nnx_spmd_trainer.export import export_params
from nnx_spmd_trainer.prefetch import Prefetch, has_position
from nnx_spmd_trainer.report import StepReport, metric_logs
from nnx_spmd_trainer.state import LiveState, ModelFactory, leaf_shardings, model_builder
from nnx_spmd_trainer.step import LossFn
from nnx_spmd_trainer.strategies import DataParallel, Strategy

DefaultMetrics = clu_metrics.Collection.create(loss=clu_metrics.Average.from_output("loss"))


class Trainer:
    """Trains an NNX model on a device mesh laid out by a strategy.

    Args:
      model: a factory ``rngs -> nnx.Module`` (run under jit inside the mesh,
        so parameters are born sharded) or an already-built ``nnx.Module``
        (built under ``nnx.use_eager_sharding(False)`` if annotated); its state
        is moved onto the mesh and ``trainer.model`` is a new object holding it.
      optimizer: any optax ``GradientTransformation``; its ``update`` also gets
        ``value=loss`` (plateau schedules and line searches read it).
      strategy: how state and batches are laid out; default ``DataParallel()``.
      loss_fn: ``(model, batch) -> (loss, aux)``; or override ``Trainer.loss_fn``.
      eval_fn: like ``loss_fn`` for evaluation; defaults to ``loss_fn``.
      metrics: a ``clu.metrics.Collection`` subclass fed ``loss=`` and ``**aux``
        inside the compiled step; default: the average loss.
      callbacks: ``Callback`` objects, called in the order given.
      seed: seeds ``nnx.Rngs`` given to the factory.
      grad_accum_steps: microbatches per step (gradients averaged in one compiled step).
      max_steps_in_flight: dispatched steps allowed to run ahead of the host.
      log_every_n_steps: training metrics reach ``logs`` every n steps (also at
        each epoch end and at the end of ``fit``); a ``MetricsLogger(n)`` asks the same.
      wrt: an NNX filter of what trains (default every ``nnx.Param``); the other
        parameters stay bit-identical, weight decay included.
      devices: the devices the mesh spans; default all of ``jax.devices()``.
      track_norms: log the global norms of the gradients (when ``train_step``
        returns ``aux["grad_norm"]``, as the default does), of the parameters and
        of their update (``train/..._norm``) at log points. They are computed only
        in the steps that end at one, by a variant of the step compiled the first
        time one comes: the other steps pay nothing for them.
      prefetch: training batches placed on the devices ahead of the steps, by a
        background thread (0: each is placed when its step starts). The data
        position a checkpoint saves stays exact; a one-shot iterator without
        ``get_state`` is never read ahead.
      config: the run's configuration, for callbacks that record it.

    Attributes:
      step: the global step, read from the optimizer's update count (the one counter).
      epoch: the epoch of the running (or last) ``fit``, counted from 0 in each call
        (or from the epoch a resumed run stopped in).
      batches_in_epoch: batches taken from ``train_iterator`` in this epoch.
      train_iterator: the iterator of the running (or last) epoch over ``train_data``
        (a Grain ``DatasetIterator`` has ``get_state()``), ``None`` before the first.
        While the epoch runs it is read ahead by the prefetch: ``train_position()``
        is where the next step's batch starts.
      train_metric_steps: steps accumulated in ``train_metrics`` since the last flush.
      eval_every_n_steps: the running ``fit``'s evaluation interval, else ``None``.
      data_shard: which rows this process feeds (``strategy.data_shard(mesh)``).

    Example::

        trainer = Trainer(lambda rngs: MLP(rngs=rngs), optax.adam(1e-3),
                          strategy=Hybrid(FSDP(4), TensorParallel(2)), loss_fn=my_loss)
        history = trainer.fit(batches, max_steps=100)
    """

    def __init__(
        self,
        model: ModelFactory | nnx.Module,
        optimizer: optax.GradientTransformation,
        *,
        strategy: Strategy | None = None,
        loss_fn: step.LossFn | None = None,
        eval_fn: step.LossFn | None = None,
        metrics: type[clu_metrics.Collection] | None = None,
        callbacks: Sequence[Callback] = (),
        seed: int = 0,
        grad_accum_steps: int = 1,
        max_steps_in_flight: int = 2,
        log_every_n_steps: int | None = None,
        wrt: nnx.filterlib.Filter = nnx.Param,
        devices: Sequence[jax.Device] | None = None,
        track_norms: bool = True,
        prefetch: int = 2,
        config: Any = None,
    ) -> None:
        if loss_fn is None and type(self).loss_fn is Trainer.loss_fn:
            raise TypeError("Trainer needs a loss: pass loss_fn=... or override Trainer.loss_fn.")
        if grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps must be >= 1, got {grad_accum_steps}.")
        self.strategy = strategy if strategy is not None else DataParallel()
        self.mesh = self.strategy.make_mesh(devices)
        self.data_shard = self.strategy.data_shard(self.mesh)
        self.tx = optimizer
        self.metrics_class = metrics if metrics is not None else DefaultMetrics
        self.grad_accum_steps = grad_accum_steps
        self.config = config
        self._loss_fn = loss_fn
        self._eval_fn = eval_fn
        self.max_steps_in_flight = max_steps_in_flight
        self._in_flight = data.InFlight(max_steps_in_flight)
        self._compiled: dict[Any, Callable[..., Any]] = {}
        self._placements: dict[Any, Any] = {}
        self._log_every: tuple[int, ...] = ()
        if log_every_n_steps is not None:
            self.request_log_every(log_every_n_steps)

        self.wrt = wrt
        self.track_norms = track_norms
        self.prefetch = prefetch
        self._batches: Prefetch | None = None
        self.report = StepReport(self.mesh.local_devices)
        self._warned_metrics: set[str] = set()
        self.init = model_builder(model, optimizer, self.strategy, self.mesh, seed, wrt)
        self._live = LiveState(nnx.merge(self.init.graphdef, self.init()))
        self._host_step: int | None = 0  # a host copy of the optimizer's count; None: read it
        self.epoch = 0
        self.batches_in_epoch = 0
        self.train_iterator: Iterator[Any] | None = None
        self.eval_every_n_steps: int | None = None
        #: Set by a callback that saved for a preemption; fit then ends without its final eval.
        self.preempted = False
        self._resume_at: data.DataPosition | None = None
        self.stop_training = False
        self.train_metrics = self.empty_metrics()
        self.eval_metrics = self.empty_metrics()
        self.train_metric_steps = 0
        #: The last step's loss and global batch, still on device (read them only when needed).
        self.last_loss: jax.Array | None = None
        self.last_batch: Any = None
        #: Set by ``TerminateOnNaN`` to the first step whose loss was not finite; a
        #: checkpoint callback must not save state from that step on.
        self.nonfinite_step: int | None = None
        self.max_steps: int | None = None
        self._train_steps: dict[bool, Any] = {}  # by whether the step computes norms
        self._train_structure: Any = None
        self._last_eval_step = -1
        self.history = History()
        self.callbacks = CallbackList([*callbacks, self.history], self)  # the trainer is complete

    # -- the state: one authority, the live objects ----------------------------------
    @property
    def model(self) -> nnx.Module:
        """The live ``nnx.Module``; its parameters are sharded on ``self.mesh``.

        It is current after every step: each step writes its results into the
        same Variables, and the next step donates their arrays, so read values
        again in each hook rather than keeping arrays. Edits to it (``set_value``)
        are what the next step trains. The steps set train/eval mode on their
        own copy; this object's mode is yours.
        """
        return self._live.objects["model"]

    @property
    def optimizer(self) -> nnx.Optimizer[nnx.Module]:
        """The live ``nnx.Optimizer``; its state is sharded like the parameters (see ``model``)."""
        return self._live.objects["optimizer"]

    @property
    def state(self) -> nnx.State:
        """``{"model": ..., "optimizer": ...}`` as one ``nnx.State``: what a checkpoint saves.

        A snapshot with its own Variables, holding this step's arrays; the next
        step donates those arrays, so copy what you keep
        (``jax.tree.map(jnp.copy, trainer.state)`` on device, or ``jax.device_get``).
        Assigning ``trainer.state = saved`` places ``saved`` with the strategy's
        shardings into the live objects (``trainer.step`` follows its optimizer
        step) and hands its arrays to the next step.
        """
        return self._live.as_state()

    @state.setter
    def state(self, state: nnx.State) -> None:
        try:
            placed = jax.device_put(state, self.init.shardings)
        except ValueError as error:
            raise ValueError(
                "The assigned state does not have the trainer's structure "
                f"({error}). Assign a state saved from a trainer built with the same model "
                "and optimizer (trainer.state)."
            ) from error
        nnx.update(self._live.objects, placed)
        self._live.refresh()
        self._host_step = None  # the optimizer count came with the state

    @property
    def state_shardings(self) -> nnx.State:
        """The NamedSharding of every state leaf, as the strategy answered."""
        return self.init.shardings

    @property
    def state_leaf_shardings(self) -> list[NamedSharding]:
        """The sharding of each array leaf of ``state``, in ``jax.tree.leaves`` order."""
        return leaf_shardings(self.init.shardings, self._live.as_state())

    @property
    def step(self) -> int:
        """The global step: the optimizer's update count, read from the state.

        A host copy follows each step without a device sync; it is re-read from
        the devices only after ``state`` was assigned.
        """
        if self._host_step is None:
            count = self.optimizer.step.get_raw_value()
            self._host_step = int(np.asarray(count.addressable_data(0)))
        return self._host_step

    @step.setter
    def step(self, value: int) -> None:
        counter = self.optimizer.step
        current = counter.get_raw_value()
        counter.set_raw_value(jax.device_put(np.asarray(value, current.dtype), current.sharding))
        self._host_step = int(value)

    # -- what subclasses override ---------------------------------------------
    def loss_fn(self, model: nnx.Module, batch: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
        """``(loss, aux)`` for one batch; called inside the compiled step."""
        assert self._loss_fn is not None
        return self._loss_fn(model, batch)

    def train_step(
        self, model: nnx.Module, optimizer: nnx.Optimizer[nnx.Module], batch: Any
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """One training step, run inside the compiled step: returns ``(loss, aux)``.

        The default takes the gradients of ``loss_fn`` (``compute_gradients``)
        and updates the parameters with them. Override it to read or change
        the gradients, add a loss, or update twice; gradient accumulation,
        the on-device metrics (fed ``loss`` and ``aux``) and the strategy's
        shardings keep working::

            class ClipByMyRule(Trainer):
                def train_step(self, model, optimizer, batch):
                    loss, aux, grads = self.compute_gradients(model, batch)
                    grads = jax.tree.map(lambda g: jnp.clip(g, -0.1, 0.1), grads)
                    optimizer.update(model, grads, value=loss)
                    return loss, {**aux, "grad_norm": optax.tree.norm(grads)}
        """
        loss, aux, grads = self.compute_gradients(model, batch)
        optimizer.update(model, grads, value=loss)  # value: plateau schedules, line searches
        # XLA drops the norm from the steps that do not report it.
        return loss, {**aux, "grad_norm": optax.tree.norm(grads)}

    def compute_gradients(
        self, model: nnx.Module, batch: Any, loss_fn: LossFn | None = None
    ) -> tuple[jax.Array, dict[str, jax.Array], nnx.State]:
        """``(loss, aux, grads)`` of ``loss_fn`` (default ``self.loss_fn``) on ``batch``,
        with respect to the ``wrt`` parameters, over ``grad_accum_steps`` microbatches."""
        return step.compute_gradients(
            model,
            batch,
            loss_fn or self.loss_fn,
            wrt=self.wrt,
            grad_accum_steps=self.grad_accum_steps,
            batch_sharding=self.strategy.batch_sharding(batch, self.mesh),
        )

    def eval_fn(self, model: nnx.Module, batch: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Evaluation loss and metrics inputs; defaults to ``loss_fn``."""
        return (self._eval_fn or self.loss_fn)(model, batch)

    # -- metrics ----------------------------------------------------------------
    def empty_metrics(self) -> clu_metrics.Collection:
        """A fresh metrics collection, replicated on the mesh."""
        return jax.device_put(self.metrics_class.empty(), NamedSharding(self.mesh, P()))

    def compute_metrics(self, split: str = "train") -> Logs:
        """Host floats of the metrics accumulated on device since the last reset.

        This is the only place a training metric leaves the devices. Values are
        global (computed over the whole sharded batch), so one replica suffices.
        """
        collection = self.train_metrics if split == "train" else self.eval_metrics
        if split == "train" and self.train_metric_steps == 0:
            return {}
        return metric_logs(collection, split, self._warned_metrics)

    def reset_metrics(self, split: str = "train") -> None:
        if split == "train":
            self.train_metrics = self.empty_metrics()
            self.train_metric_steps = 0
        else:
            self.eval_metrics = self.empty_metrics()

    def flush_train_metrics(self) -> Logs:
        """Computes and resets the training metrics: ``{"train/loss": ...}``, with the
        last step's norms, compile time and device memory (``StepReport``) and the epoch."""
        logs = self.compute_metrics("train")
        if logs:
            logs.update(self.report.read(), epoch=float(self.epoch))
        self.reset_metrics("train")
        return logs

    def request_log_every(self, n: int) -> None:
        """Training metrics reach ``logs`` every ``n`` steps (each request adds its steps)."""
        if n < 1:
            raise ValueError(f"log_every_n_steps must be >= 1, got {n}.")
        self._log_every = tuple(sorted({*self._log_every, n}))

    def is_log_step(self, step: int) -> bool:
        """Whether training metrics are flushed into ``logs`` after ``step``."""
        return any(step % n == 0 for n in self._log_every)

    # -- compiled steps ------------------------------------------------------------
    def _compile(self, kind: str, batch: Any, *, norms: bool = False) -> Any:
        live = self._live
        batch_sharding = self.strategy.batch_sharding(batch, self.mesh)
        key = (kind, norms, live.graphdef, jax.tree.structure(batch), self.grad_accum_steps)
        if key in self._compiled:
            return self._compiled[key]
        replicated = NamedSharding(self.mesh, P())
        state_shardings = self.state_leaf_shardings
        if kind == "train":
            fn = step.make_train_step(live.graphdef, self.train_step, wrt=self.wrt, norms=norms)
            out: Any = (state_shardings, replicated, replicated, replicated)
            donate: tuple[int, ...] = (0, 1)
        else:
            fn = step.make_eval_step(live.graphdef, self.eval_fn)
            out, donate = replicated, ()
        flat = step.over_flat_state(fn, live.treedef, returns_state=kind == "train")
        compiled = self.strategy.compile_step(
            step.traced_within(
                self.strategy.transform_step(flat), lambda: self.strategy.trace_context(self.mesh)
            ),
            in_shardings=(state_shardings, replicated, batch_sharding),
            out_shardings=out,
            donate_argnums=donate,
        )
        self._compiled[key] = compiled
        return compiled

    def place(self, batch: Any, *, divisor: int = 1) -> Any:
        """This process's batch -> global arrays with the strategy's batch sharding.

        The strategy is asked, and the batch checked, once per batch structure
        and shapes; later batches of the same kind go straight to the devices.
        """
        leaves, treedef = jax.tree.flatten(batch)
        key = (treedef, tuple(np.shape(x) for x in leaves), divisor)
        shardings = self._placements.get(key)
        if shardings is None:
            shardings = self.strategy.batch_sharding(batch, self.mesh)
            data.check_batch(batch, shardings, divisor=divisor, data_shards=self.data_shard.count)
            self._placements[key] = shardings
        return data.transfer_batch(batch, shardings, data_shards=self.data_shard.count)

    def padded(self, batch: Any, *, divisor: int | None = None) -> Any:
        """``batch`` (a dict) with rows padded to a count the mesh can split, and a
        ``"mask"`` marking the padding (``data.pad_batch``).

        Evaluation pads a batch that needs it by itself; for training, ask for it:
        ``trainer.fit(map(trainer.padded, data))`` or ``dataset.map(trainer.padded)``.
        The metrics leave the padding out; the loss does when it averages with
        ``masked_mean(per_example_losses, batch)``. ``divisor`` defaults to
        ``grad_accum_steps``.
        """
        divisor = self.grad_accum_steps if divisor is None else divisor
        shardings = self.strategy.batch_sharding(batch, self.mesh)
        multiple = data.rows_multiple(shardings, divisor=divisor, data_shards=self.data_shard.count)
        return data.pad_batch(batch, multiple)

    def _eval_batch(self, batch: Any) -> Any:
        """An eval batch as is, or padded and masked if its rows do not split."""
        leaves = jax.tree.leaves(batch)
        if not isinstance(batch, Mapping) or not leaves or not np.shape(leaves[0]):
            return batch  # placement names what is wrong
        shardings = self.strategy.batch_sharding(batch, self.mesh)
        multiple = data.rows_multiple(shardings, data_shards=self.data_shard.count)
        return batch if len(leaves[0]) % multiple == 0 else data.pad_batch(batch, multiple)

    def lower_train_step(self, batch: Any) -> Any:
        """``jax.jit(...).lower`` of the train step on ``batch``, for memory/cost analysis."""
        placed = self.place(batch, divisor=self.grad_accum_steps)
        train_step = self._compile("train", placed)
        with jax.set_mesh(self.mesh):
            return train_step.lower(self._live.arrays(), self.train_metrics, placed)

    # -- the loops ---------------------------------------------------------------
    def fit(
        self,
        train_data: Iterable[Any],
        eval_data: Iterable[Any] | None = None,
        *,
        max_steps: int | None = None,
        epochs: int | None = None,
        eval_every_n_steps: int | None = None,
    ) -> History:
        """Trains for ``max_steps`` steps or ``epochs`` passes, whichever ends first.

        Training metrics accumulate on device; they reach ``logs`` at the log
        steps (``log_every_n_steps``), at epoch ends and at the end. ``eval_data``
        is evaluated every ``eval_every_n_steps`` steps and at the end.

        If anything raises (the data, a callback, the step), callbacks get
        ``on_exception`` (profiler, writers and bars close), the state stays the
        last completed step's, and the error propagates; ``fit`` can be called again.
        """
        if max_steps is None and epochs is None:
            raise ValueError("fit needs max_steps=... or epochs=... to know when to stop.")
        if eval_every_n_steps is not None and eval_data is None:
            raise ValueError("eval_every_n_steps was given without eval_data.")
        self.stop_training = self.preempted = False
        self.max_steps = max_steps
        self.eval_every_n_steps = eval_every_n_steps
        self._train_steps, self._train_structure = {}, None  # compiled in each fit
        self._last_eval_step = -1
        self._live.refresh()  # the user may have changed the model between fits
        self.report.restart()
        try:
            self.callbacks.on_fit_start({})  # may restore state and resume_data_at(...)
            self.callbacks.on_train_begin({})
            if max_steps is not None and self.step >= max_steps:
                warnings.warn(
                    f"fit(max_steps={max_steps}) trains no step: the trainer is already at "
                    f"step {self.step}, and max_steps is the global step to stop at. Pass "
                    f"max_steps={self.step} + n to train n more steps.",
                    stacklevel=2,
                )
            first = self._resume_at.epoch if self._resume_at else 0
            for epoch in itertools.count(first) if epochs is None else range(first, epochs):
                if self._done(max_steps):
                    break
                self.epoch = epoch
                self.callbacks.on_epoch_begin(epoch, {})
                if self._train_epoch(train_data, eval_data, max_steps, eval_every_n_steps) == 0:
                    if epoch == first:
                        raise ValueError("train_data yielded no batches.")
                    asked = f"epochs={epochs}" if epochs is not None else f"max_steps={max_steps}"
                    warnings.warn(
                        f"train_data was exhausted at step {self.step}, in epoch {epoch} of "
                        f"{asked}: it is a one-shot iterator, so only {epoch} epoch(s) ran. "
                        "Pass a re-iterable dataset (a list, a grain.MapDataset) to run "
                        "several epochs.",
                        stacklevel=2,
                    )
                    break
                if self.preempted:  # mid-epoch: the resumed run ends this epoch, not us
                    break
                self.callbacks.on_epoch_end(epoch, self._epoch_logs())
            self._in_flight.drain()
            if self.preempted:
                # The saved accumulators carry the steps since the last log point; a
                # partial average logged here would be a point the resumed run never has.
                self.callbacks.on_train_end({})
            else:
                if eval_data is not None and self._last_eval_step != self.step:
                    self._evaluate(eval_data)
                self.callbacks.on_train_end(self.flush_train_metrics())
            self.callbacks.on_fit_end({})
        except BaseException as error:
            self._abort(error)
            raise
        finally:
            self.eval_every_n_steps = None
            self._resume_at = None  # a resume point is for this fit only
        return self.history

    def resume_data_at(
        self,
        *,
        epoch: int,
        batches: int,
        restore_iterator: Callable[[Iterator[Any]], bool] | None = None,
    ) -> None:
        """The next ``fit`` starts in ``epoch``, after its first ``batches`` batches.

        When that epoch's iterator is created, ``restore_iterator(iterator)`` may
        set its position (a Grain iterator's saved state) and return True;
        otherwise the trainer reads and discards ``batches`` batches, with a
        warning: exact, but it costs their loading time. A checkpoint callback
        calls this from ``on_fit_start``.
        """
        self._resume_at = data.DataPosition(epoch, batches, restore_iterator)

    def _abort(self, error: BaseException) -> None:
        """The exception path of ``fit``: settle the devices, tell the callbacks."""
        with contextlib.suppress(Exception):  # a failed device step raises again here
            self._in_flight.drain()
        self._in_flight.clear()
        self.train_iterator = self._batches = None
        if any(leaf.is_deleted() for leaf in jax.tree.leaves(self.train_metrics)):
            self.reset_metrics("train")  # donated to the failed step
        if any(array.is_deleted() for array in self._live.arrays()):
            error.add_note(
                f"nnx_spmd_trainer: the step after step {self._host_step} failed on the "
                "devices after its input state was donated, so that state is lost; restore "
                "a checkpoint (trainer.state = saved) before training on."
            )
        self.callbacks.on_exception(error)

    def _train_epoch(
        self,
        train_data: Iterable[Any],
        eval_data: Iterable[Any] | None,
        max_steps: int | None,
        eval_every_n_steps: int | None,
    ) -> int:
        """One pass over ``train_data`` (or until done); returns the batches of the epoch
        taken, those a resumed run had taken before included."""
        self.train_iterator = iterator = iter(train_data)
        self.batches_in_epoch = 0
        if self._resume_at is not None:
            self.batches_in_epoch = data.seek(iterator, self._resume_at)
            self._resume_at = None
        # A one-shot iterator with no position cannot be set back after running ahead.
        ahead = self.prefetch if iterator is not train_data or has_position(iterator) else 0
        self._batches = Prefetch(
            iterator,
            lambda b: self.place(b, divisor=self.grad_accum_steps),
            ahead,
            waiting=lambda: self.report.timing("data_wait"),
        )
        try:
            with jax.set_mesh(self.mesh):
                self._train_batches(eval_data, max_steps, eval_every_n_steps)
        finally:
            self._batches.close()  # the iterator is left exactly after the last step's batch
        return self.batches_in_epoch  # train_iterator stays: a final checkpoint saves it

    def _train_batches(
        self, eval_data: Iterable[Any] | None, max_steps: int | None, eval_every_n_steps: int | None
    ) -> None:
        assert self._batches is not None
        for _, batch in self._batches:
            self.batches_in_epoch += 1
            # Hooks get the steps done so far at begin, and the new count at end.
            self.callbacks.on_train_batch_begin(self.step, {})
            self._train_one(batch, norms=self.track_norms and self.is_log_step(self.step + 1))
            logs = self.flush_train_metrics() if self.is_log_step(self.step) else {}
            self.callbacks.on_train_batch_end(self.step, logs)
            if eval_every_n_steps and self.step % eval_every_n_steps == 0:
                assert eval_data is not None
                self._evaluate(eval_data)
                self._last_eval_step = self.step
            self.callbacks.on_step_end(self.step)
            if self._done(max_steps):
                break

    def train_position(self) -> Any:
        """The position of the next training batch, for ``grain.checkpoint.CheckpointSave``:
        the Grain iterator itself, or, while batches are prefetched ahead of it, a
        ``Position`` recorded after the last batch a step took."""
        return self._batches.position() if self._batches else self.train_iterator

    def _train_one(self, batch: Any, *, norms: bool) -> None:
        structure = jax.tree.structure(batch)
        known = len(self._compiled)
        if self._train_structure is None or structure != self._train_structure:
            self._train_steps, self._train_structure = {}, structure
        count = self.step  # before dispatch: afterwards the counter is a future array
        if norms not in self._train_steps:
            self._train_steps[norms] = self._compile("train", batch, norms=norms)
        # A new step traces and compiles in its first call (dispatch is asynchronous).
        timing = (
            self.report.timing("compile")
            if len(self._compiled) > known
            else contextlib.nullcontext()
        )
        try:
            with timing:
                arrays, self.train_metrics, loss, self.report.norms = self._train_steps[norms](
                    self._live.arrays(), self.train_metrics, batch
                )
        except Exception as error:
            data.note_batch_change(error, count + 1, self.last_batch, batch)
            raise
        self._live.write(arrays)
        self._host_step = count + 1  # the step's optimizer.update counted one update
        self.last_loss, self.last_batch = loss, batch
        self._in_flight.add(loss)
        self.train_metric_steps += 1

    def _done(self, max_steps: int | None) -> bool:
        return self.stop_training or (max_steps is not None and self.step >= max_steps)

    def _epoch_logs(self) -> Logs:
        self._in_flight.drain()
        return self.flush_train_metrics()

    def evaluate(self, eval_data: Iterable[Any]) -> dict[str, float]:
        """Runs ``eval_fn`` over all of ``eval_data``; returns ``{"loss": ..., ...}``."""
        logs = self._evaluate(eval_data)
        return {key.removeprefix("eval/"): value for key, value in logs.items()}

    def _evaluate(self, eval_data: Iterable[Any]) -> Logs:
        with self.report.timing("eval"):
            return self._evaluate_timed(eval_data)

    def _evaluate_timed(self, eval_data: Iterable[Any]) -> Logs:
        arrays = self._live.arrays()
        self.reset_metrics("eval")
        self.callbacks.on_test_begin({})
        batches = 0
        eval_step, structure = None, None
        with jax.set_mesh(self.mesh):
            for batches, host_batch in enumerate(eval_data, start=1):
                batch = self.place(self._eval_batch(host_batch))
                self.callbacks.on_test_batch_begin(batches, {})
                if eval_step is None or jax.tree.structure(batch) != structure:
                    eval_step = self._compile("eval", batch)
                    structure = jax.tree.structure(batch)
                self.eval_metrics = eval_step(arrays, self.eval_metrics, batch)
                self._in_flight.add(jax.tree.leaves(self.eval_metrics)[0])
                self.callbacks.on_test_batch_end(batches, {})
        if batches == 0:
            raise ValueError("eval_data yielded no batches.")
        self._in_flight.drain()
        logs = self.compute_metrics("eval")
        self.callbacks.on_test_end(logs)
        return logs

    def export(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
        """Writes the model's parameters where plain Orbax loads them (``export_params``).

        ``orbax.checkpoint.PyTreeCheckpointer().restore(path)`` gives the
        model's tree of unsharded NumPy arrays, with no code of this library.
        """
        return export_params(self.model, path, overwrite=overwrite)

    @property
    def num_devices(self) -> int:
        return math.prod(self.mesh.shape.values())
