"""Trainer: owns the mesh, the model and the optimizer; runs fit and evaluate."""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Callable, Iterable, Sequence
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
from nnx_spmd_trainer.state import ModelFactory, model_builder
from nnx_spmd_trainer.strategies import DataParallel, Strategy

DefaultMetrics = clu_metrics.Collection.create(loss=clu_metrics.Average.from_output("loss"))


class Trainer:
    """Trains an NNX model on a device mesh laid out by a strategy.

    Args:
      model: a factory ``rngs -> nnx.Module`` (run under jit inside the mesh,
        so parameters are born sharded) or an already-built ``nnx.Module``
        (built under ``nnx.use_eager_sharding(False)`` if annotated); its state
        is moved onto the mesh and ``trainer.model`` is a new object holding it.
      optimizer: any optax ``GradientTransformation``.
      strategy: how state and batches are laid out; default ``DataParallel()``.
      loss_fn: ``(model, batch) -> (loss, aux)``; or override ``Trainer.loss_fn``.
      eval_fn: like ``loss_fn`` for evaluation; defaults to ``loss_fn``.
      metrics: a ``clu.metrics.Collection`` subclass fed ``loss=`` and ``**aux``
        inside the compiled step; default: the average loss.
      callbacks: ``Callback`` objects, called in ascending ``order``.
      seed: seeds ``nnx.Rngs`` given to the factory.
      grad_accum_steps: microbatches per step (gradients averaged in one compiled step).
      max_steps_in_flight: dispatched steps allowed to run ahead of the host.
      config: the run's configuration, for callbacks that record it.

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
        config: Any = None,
    ) -> None:
        if loss_fn is None and type(self).loss_fn is Trainer.loss_fn:
            raise TypeError("Trainer needs a loss: pass loss_fn=... or override Trainer.loss_fn.")
        if grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps must be >= 1, got {grad_accum_steps}.")
        self.strategy = strategy if strategy is not None else DataParallel()
        self.mesh = self.strategy.make_mesh()
        self.tx = optimizer
        self.metrics_class = metrics if metrics is not None else DefaultMetrics
        self.grad_accum_steps = grad_accum_steps
        self.config = config
        self._loss_fn = loss_fn
        self._eval_fn = eval_fn
        self.max_steps_in_flight = max_steps_in_flight
        self._in_flight = data.InFlight(max_steps_in_flight)
        self._compiled: dict[Any, Callable[..., Any]] = {}

        self.init = model_builder(model, optimizer, self.strategy, self.mesh, seed)
        self._state: nnx.State = self.init()
        objects = nnx.merge(self.init.graphdef, self._state)
        self._model: nnx.Module = objects["model"]
        self._optimizer: nnx.Optimizer[nnx.Module] = objects["optimizer"]
        self._views_current = True
        self.step = 0
        self.stop_training = False
        self.train_metrics = self.empty_metrics()
        self.eval_metrics = self.empty_metrics()
        self._train_metric_steps = 0
        #: The last step's loss and global batch, still on device (read them only when needed).
        self.last_loss: jax.Array | None = None
        self.last_batch: Any = None
        #: Set by ``TerminateOnNaN`` to the first step whose loss was not finite; a
        #: checkpoint callback must not save state from that step on.
        self.nonfinite_step: int | None = None
        self.max_steps: int | None = None
        self._train_step: Any = None
        self._train_structure: Any = None
        self._last_eval_step = -1
        self.history = History()
        self.callbacks = CallbackList([*callbacks, self.history], self)  # the trainer is complete

    # -- the objects users see -------------------------------------------------
    @property
    def model(self) -> nnx.Module:
        """The live ``nnx.Module``; its parameters are sharded on ``self.mesh``.

        During ``fit`` the arrays are brought up to date when this property is
        read, and the next step donates them: read ``trainer.model`` again in
        each hook rather than keeping it. It is in training mode (``model.train()``)
        outside ``evaluate``; call ``model.eval()`` yourself for inference.
        """
        self._sync_views()
        return self._model

    @property
    def optimizer(self) -> nnx.Optimizer[nnx.Module]:
        """The live ``nnx.Optimizer``; its state is sharded like the parameters (see ``model``)."""
        self._sync_views()
        return self._optimizer

    @property
    def state(self) -> nnx.State:
        """``{"model": ..., "optimizer": ...}`` as one ``nnx.State``: what a checkpoint saves.

        The arrays are this step's and the next step donates them: copy what you
        keep (``jax.tree.map(jnp.copy, trainer.state)`` on device, or
        ``jax.device_get``). Assigning ``trainer.state = saved`` places ``saved``
        with the strategy's shardings and hands its arrays to the next step.
        """
        if self._views_current:  # the user may have edited model/optimizer in place
            # New containers: nnx.state shares the live Variables, which later syncs rewrite.
            self._state = jax.tree.map(lambda x: x, nnx.state(self._objects()))
        return self._state

    @state.setter
    def state(self, state: nnx.State) -> None:
        self._state = jax.device_put(state, self.init.shardings)
        self._views_current = False

    @property
    def state_shardings(self) -> nnx.State:
        """The NamedSharding of every state leaf, as the strategy answered."""
        return self.init.shardings

    def _objects(self) -> dict[str, Any]:
        return {"model": self._model, "optimizer": self._optimizer}

    def _sync_views(self) -> None:
        if not self._views_current:
            nnx.update(self._objects(), self._state)
            self._views_current = True

    # -- what subclasses override ---------------------------------------------
    def loss_fn(self, model: nnx.Module, batch: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
        """``(loss, aux)`` for one batch; called inside the compiled step."""
        assert self._loss_fn is not None
        return self._loss_fn(model, batch)

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
        if split == "train" and self._train_metric_steps == 0:
            return {}
        local = jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), collection)
        values = {}
        for name, value in local.compute().items():
            value = np.asarray(value)
            if value.size == 1:
                values[f"{split}/{name}"] = float(value)
        return values

    def reset_metrics(self, split: str = "train") -> None:
        if split == "train":
            self.train_metrics = self.empty_metrics()
            self._train_metric_steps = 0
        else:
            self.eval_metrics = self.empty_metrics()

    def flush_train_metrics(self) -> Logs:
        """Computes and resets the training metrics: ``{"train/loss": ...}``."""
        logs = self.compute_metrics("train")
        self.reset_metrics("train")
        return logs

    # -- compiled steps ------------------------------------------------------------
    def _graphdef(self, training: bool) -> nnx.GraphDef[Any]:
        self._sync_views()
        if training:
            self._model.train()
        else:
            self._model.eval()
        return nnx.graphdef(self._objects())

    def _compile(self, kind: str, graphdef: nnx.GraphDef[Any], batch: Any) -> Any:
        batch_sharding = self.strategy.batch_sharding(batch, self.mesh)
        key = (kind, graphdef, jax.tree.structure(batch), self.grad_accum_steps)
        if key in self._compiled:
            return self._compiled[key]
        replicated = NamedSharding(self.mesh, P())
        if kind == "train":
            fn = step.make_train_step(
                graphdef,
                self.loss_fn,
                grad_accum_steps=self.grad_accum_steps,
                batch_sharding=batch_sharding,
            )
            out: Any = (self.init.shardings, replicated, replicated)
            donate: tuple[int, ...] = (0, 1)
        else:
            fn = step.make_eval_step(graphdef, self.eval_fn)
            out, donate = replicated, ()
        compiled = self.strategy.compile_step(
            fn,
            in_shardings=(self.init.shardings, replicated, batch_sharding),
            out_shardings=out,
            donate_argnums=donate,
        )
        self._compiled[key] = compiled
        return compiled

    def place(self, batch: Any, *, divisor: int = 1) -> Any:
        """This process's NumPy batch -> global arrays with the strategy's batch sharding."""
        shardings = self.strategy.batch_sharding(batch, self.mesh)
        return data.place_batch(batch, shardings, divisor=divisor)

    def lower_train_step(self, batch: Any) -> Any:
        """``jax.jit(...).lower`` of the train step on ``batch``, for memory/cost analysis."""
        placed = self.place(batch, divisor=self.grad_accum_steps)
        train_step = self._compile("train", self._graphdef(training=True), placed)
        with jax.set_mesh(self.mesh):
            return train_step.lower(self.state, self.train_metrics, placed)

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

        Training metrics accumulate on device; they reach ``logs`` at epoch
        ends, at the end, and wherever a callback (``MetricsLogger``) asks.
        ``eval_data`` is evaluated every ``eval_every_n_steps`` steps and at the end.
        """
        if max_steps is None and epochs is None:
            raise ValueError("fit needs max_steps=... or epochs=... to know when to stop.")
        if eval_every_n_steps is not None and eval_data is None:
            raise ValueError("eval_every_n_steps was given without eval_data.")
        self.stop_training = False
        self.max_steps = max_steps
        self._train_step = None  # compiled on the first batch of each fit
        self._last_eval_step = -1
        self.callbacks.call("on_train_begin", {})  # may restore state: read it only after
        for epoch in itertools.count() if epochs is None else range(epochs):
            if self._done(max_steps):
                break
            self.callbacks.call("on_epoch_begin", epoch, {})
            if self._train_epoch(train_data, eval_data, max_steps, eval_every_n_steps) == 0:
                if epoch == 0:
                    raise ValueError("train_data yielded no batches.")
                warnings.warn(
                    f"train_data was exhausted at step {self.step} before max_steps={max_steps}; "
                    "pass a re-iterable dataset (not a one-shot iterator) to run several epochs.",
                    stacklevel=2,
                )
                break
            self.callbacks.call("on_epoch_end", epoch, self._epoch_logs())
        self._in_flight.drain()
        if eval_data is not None and self._last_eval_step != self.step:
            self._evaluate(eval_data)
        self.callbacks.call("on_train_end", self.flush_train_metrics())
        self._sync_views()
        return self.history

    def _train_epoch(
        self,
        train_data: Iterable[Any],
        eval_data: Iterable[Any] | None,
        max_steps: int | None,
        eval_every_n_steps: int | None,
    ) -> int:
        """One pass over ``train_data`` (or until done); returns the steps taken."""
        steps = 0
        with jax.set_mesh(self.mesh):
            for host_batch in train_data:  # one batch at a time: the iterator's position is exact
                batch = self.place(host_batch, divisor=self.grad_accum_steps)
                # Hooks get the steps done so far at begin, and the new count at end.
                self.callbacks.call("on_train_batch_begin", self.step, {})
                self._train_one(batch)
                steps += 1
                self.callbacks.call("on_train_batch_end", self.step, {})
                if eval_every_n_steps and self.step % eval_every_n_steps == 0:
                    assert eval_data is not None
                    self._evaluate(eval_data)
                    self._last_eval_step = self.step
                if self._done(max_steps):
                    break
        return steps

    def _train_one(self, batch: Any) -> None:
        structure = jax.tree.structure(batch)
        if self._train_step is None or structure != self._train_structure:
            self._train_step = self._compile("train", self._graphdef(training=True), batch)
            self._train_structure = structure
        # self.state, not a local: a callback may have set trainer.state or edited the model.
        state, self.train_metrics, loss = self._train_step(self.state, self.train_metrics, batch)
        self._state, self._views_current = state, False
        self.last_loss, self.last_batch = loss, batch
        self._in_flight.add(loss)
        self.step += 1
        self._train_metric_steps += 1

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
        graphdef = self._graphdef(training=False)
        state = self.state
        self.reset_metrics("eval")
        self.callbacks.call("on_test_begin", {})
        batches = 0
        eval_step, structure = None, None
        with jax.set_mesh(self.mesh):
            for batches, host_batch in enumerate(eval_data, start=1):
                batch = self.place(host_batch)
                self.callbacks.call("on_test_batch_begin", batches, {})
                if eval_step is None or jax.tree.structure(batch) != structure:
                    eval_step = self._compile("eval", graphdef, batch)
                    structure = jax.tree.structure(batch)
                self.eval_metrics = eval_step(state, self.eval_metrics, batch)
                self._in_flight.add(jax.tree.leaves(self.eval_metrics)[0])
                self.callbacks.call("on_test_batch_end", batches, {})
        if batches == 0:
            raise ValueError("eval_data yielded no batches.")
        self._in_flight.drain()
        self._graphdef(training=True)  # back to the trainer's default mode
        logs = self.compute_metrics("eval")
        self.callbacks.call("on_test_end", logs)
        return logs

    @property
    def num_devices(self) -> int:
        return math.prod(self.mesh.shape.values())
