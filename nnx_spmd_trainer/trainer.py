"""Trainer: the constructor, the user's overrides and the entry points (``Loop`` runs
them; the ``Run`` holds the run's state). The members that reach the run and the layout
are its mixins' (``run_access.RunAccess``, ``plan_holder.LayoutAccess``)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import jax
import optax
from clu import metrics as clu_metrics
from flax import nnx

from nnx_spmd_trainer.engine import plan_holder, predict
from nnx_spmd_trainer.engine.hooks import BaseCallback, CallbackList, History
from nnx_spmd_trainer.engine.loop import Loop
from nnx_spmd_trainer.engine.metric_log import LogSchedule
from nnx_spmd_trainer.engine.plan_holder import LayoutAccess
from nnx_spmd_trainer.engine.run import Run
from nnx_spmd_trainer.engine.run_access import RunAccess
from nnx_spmd_trainer.engine.speed import Speed
from nnx_spmd_trainer.io.export import export_params
from nnx_spmd_trainer.nn.lora import LoRA
from nnx_spmd_trainer.optim import ema as ema_lib
from nnx_spmd_trainer.optim.ema import EMA
from nnx_spmd_trainer.optim.spikes import SpikeSkip
from nnx_spmd_trainer.planner import auto, step
from nnx_spmd_trainer.planner.compile_cache import CompileCacheSetting, use_compile_cache
from nnx_spmd_trainer.planner.plan import Plan
from nnx_spmd_trainer.planner.settings import DEFAULTS, PlanSettings
from nnx_spmd_trainer.planner.state import ModelFactory
from nnx_spmd_trainer.planner.step import LossFn
from nnx_spmd_trainer.strategies import Strategy
from nnx_spmd_trainer.weights import Pretrained, WeightMap, save_safetensors


class Trainer(LayoutAccess, RunAccess):
    """Trains an NNX model on a device mesh laid out by a strategy.

    Args:
      model: a factory ``rngs -> nnx.Module`` (run under jit inside the mesh,
        so parameters are born sharded), an already-built ``nnx.Module``
        (built under ``nnx.use_eager_sharding(False)`` if annotated; its state
        is moved onto the mesh and ``trainer.model`` is a new object holding
        it), or a ``Plan`` (then give no optimizer, strategy, metrics, seed, grad_accum_steps,
        wrt, devices, donate, remat, skip_nonfinite_updates, ema or skip_spikes: the plan
        holds them).
      optimizer: any optax ``GradientTransformation``; its ``update`` also gets
        ``value=loss`` (plateau schedules and line searches read it).
      strategy: how state and batches are laid out; default ``DataParallel()``.
        ``"auto"`` (or ``auto.Auto(...)``): the first ``fit`` plans every layout the
        devices allow, times those that fit on its first batches and trains with the
        fastest (``choose_layout``).
      loss_fn: ``(model, batch) -> (loss, aux)``; or override ``Trainer.loss_fn``.
      eval_fn: like ``loss_fn`` for evaluation; defaults to ``loss_fn``.
      predict_fn: ``(model, batch) -> outputs`` for ``predict``; or override
        ``Trainer.predict_fn``. Default: ``model(batch["x"])`` (``model(batch)`` for
        a batch that is not a dict).
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
        ``get_state`` is never read ahead. Default: measured per backend
        (``backend_defaults``: 2 on accelerators, 0 on the CPU).
      donate: the state's buffers given to each train step (``Plan``'s ``donate``);
        default: measured per backend (on wherever measured so far).
      remat: the activation-checkpointing policy ``loss_fn`` runs under (``Plan``'s
        ``remat``: a name in ``remat.POLICIES``, e.g. ``"dots_saveable"``); a
        ``train_step`` override gets it through ``compute_gradients``. Default ``"none"``.
      skip_nonfinite_updates: a step whose loss or new parameters are not finite
        changes neither the weights nor the optimizer's state (``Plan``'s), so a
        ``TerminateOnNaN`` stop leaves the last finite weights in memory. Default ``False``.
      ema: an ``EMA(decay=..., warmup=...)``: an average of the weights kept in the
        optimizer's state, on the devices and in every checkpoint; ``ema_weights()``
        puts it in the model for evaluation, prediction or export (``Plan``'s).
      skip_spikes: a ``SpikeSkip(z=..., window=...)``: a step whose loss or gradient
        norm spikes above the recent ones is skipped on the devices; the count is
        logged as ``train/skipped_spikes`` (``Plan``'s).
      memory_budget_bytes: for ``strategy="auto"``: the per-device memory a layout's
        compiled step must fit in (default: the device's own limit, where reported).
      peak_flops: one device's peak FLOP/s, for ``perf/mfu`` at each log point (with
        ``perf/tokens_per_s`` and ``perf/flops_per_s_per_device``: ``engine.speed``).
        Default: the dense bf16 peak of the device's kind (``flops.PEAK_FLOPS``); a
        device not in the table logs no MFU, and says so once.
      lora: a ``LoRA(rank=..., targets=...)``: low-rank adapters beside the target layers,
        added after ``init_from`` loads the base (which needs no adapters in its files),
        laid out from their base layers under any strategy; only they train and have
        optimizer state (``Plan``'s; ``nn.lora.merge`` folds them in for export).
      init_from: pretrained weights the first state is built from
        (``weights.Pretrained(path, weight_map)``: safetensors, NumPy or Orbax, read
        straight into the layout) instead of the random initialiser; a run that
        ``fit`` resumes from its own checkpoints restores those instead.
      config: the run's configuration, for callbacks that record it.
      compile_cache: where JAX's persistent compilation cache keeps compiled programs
        for the next run (a directory), or ``"off"``. Default: the environment variable
        ``NNX_SPMD_TRAINER_COMPILE_CACHE``, else JAX's own cache where configured, else
        ``$XDG_CACHE_HOME/nnx_spmd_trainer/jax`` (``planner.compile_cache``). JAX's
        cache is one per process: the last ``Trainer`` built sets it.

    The state is built when first needed (``model``, ``optimizer``, ``state``,
    or the first step), so a checkpoint restored at the start of ``fit``
    (``load_run_state``) is read straight into the plan's layout and the
    initial state is never built.

    Attributes:
      plan: the layout and the compiled steps (``Plan``); ``mesh`` and
        ``strategy`` are its. With ``strategy="auto"``, these, ``placement``,
        ``metric_log`` and the state exist once the layout is chosen (``choose_layout``).
      layout_choice: with ``strategy="auto"``, the ranking of the layouts and the
        one chosen (``auto.Choice``); ``None`` otherwise.
      run: every mutable piece of the run (``Run``: the live state, the step, the
        metric accumulators, the progress, the resume point); ``run_state()`` is
        its snapshot. ``progress`` and ``metric_log`` are its.
      progress: where the running (or last) ``fit`` is (``Progress``: epoch,
        batches, the train iterator and its position, preemption). Read-only
        for callbacks: they ask with ``request_stop``.
      metric_log: the plan's on-device metric accumulators (``MetricLog``). ``report``
        is its deprecated name (``report`` is a ``PlanReport``: ``plan.report``).
      log_schedule: when training metrics reach ``logs`` (``LogSchedule``:
        ``log_schedule.request_log_every(n)``, ``track_norms``).
      last_step: the last training step (``StepRecord``: step, loss on device, batch
        shapes, host timings); each callback is handed it as ``self.step_record``.
      placement: batch placement (``Placement``: ``place``, ``data_shard``,
        ``prefetch``, the in-flight bound).
      stop_requested: whether ``fit`` ends after the current step (``request_stop``;
        ``stop_training``, Keras's spelling, is a deprecated alias).
      history: the logged values of every ``fit`` (a ``History`` callback).

    Example::

        trainer = Trainer(lambda rngs: MLP(rngs=rngs), optax.adam(1e-3),
                          strategy=Hybrid(FSDP(4), TensorParallel(2)), loss_fn=my_loss)
        history = trainer.fit(batches, max_steps=100)
    """

    def __init__(
        self,
        model: ModelFactory | nnx.Module | Plan,
        optimizer: optax.GradientTransformation | None = None,
        *,
        strategy: Strategy | str | auto.Auto | None = None,
        loss_fn: step.LossFn | None = None,
        eval_fn: step.LossFn | None = None,
        predict_fn: Callable[[nnx.Module, Any], Any] | None = None,
        metrics: type[clu_metrics.Collection] | None = DEFAULTS.metrics,
        callbacks: Sequence[BaseCallback[Any]] = (),
        seed: int = DEFAULTS.seed,
        grad_accum_steps: int = DEFAULTS.grad_accum_steps,
        max_steps_in_flight: int = 2,
        log_every_n_steps: int | None = None,
        wrt: nnx.filterlib.Filter = DEFAULTS.wrt,
        devices: Sequence[jax.Device] | None = DEFAULTS.devices,
        track_norms: bool = True,
        prefetch: int | None = None,
        donate: bool | None = DEFAULTS.donate,
        remat: str = DEFAULTS.remat,
        skip_nonfinite_updates: bool = DEFAULTS.skip_nonfinite_updates,
        ema: EMA | None = DEFAULTS.ema,
        skip_spikes: SpikeSkip | None = DEFAULTS.skip_spikes,
        lora: LoRA | None = DEFAULTS.lora,
        memory_budget_bytes: int | None = None,
        peak_flops: float | None = None,
        init_from: Pretrained | None = None,
        config: Any = None,
        compile_cache: CompileCacheSetting = None,
    ) -> None:
        use_compile_cache(compile_cache)  # before anything compiles
        settings = PlanSettings.of(locals())  # the thirteen keywords the plan is made with
        plan, pending = plan_holder.plan_or_chooser(
            model,
            settings,
            loss_fn=loss_fn,
            eval_fn=eval_fn,
            memory_budget_bytes=memory_budget_bytes,
        )
        self._loss_fn = loss_fn or (plan.loss_fn if plan else None)
        self._eval_fn = eval_fn or (plan.eval_fn if plan else None)
        self._predict_fn = predict_fn
        if self._loss_fn is None and type(self).loss_fn is Trainer.loss_fn:
            raise TypeError("Trainer needs a loss: pass loss_fn=... or override Trainer.loss_fn.")
        self.config = config
        self.run = Run(LogSchedule(log_every_n_steps, track_norms=track_norms))
        self.run.timings.speed = Speed(peak_flops)
        # A plan's LoRA adapters are its initializer's: init_from leaves them out itself
        # (Pretrained.fresh_in), so a job's check before training reads the same leaves.
        self.run.initial_state = init_from.state if init_from is not None else None
        self._plan_holder = plan_holder.PlanHolder(
            self.run,
            pending,
            prefetch=prefetch,
            max_steps_in_flight=max_steps_in_flight,
        )
        if plan is not None:
            self._plan_holder.adopt(plan)
        self._loop = Loop(
            self, overrides_train_step=type(self).train_step is not Trainer.train_step
        )
        self.history = History()
        self.callbacks = CallbackList([*callbacks, self.history], self)  # the trainer is complete
        self.run.callbacks = self.callbacks

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
        the gradients, add a loss, or update twice (``trainer.step`` follows
        the optimizer's count); gradient accumulation, the on-device metrics
        (fed ``loss`` and ``aux``) and the strategy's shardings keep working::

            class ClipByMyRule(Trainer):
                def train_step(self, model, optimizer, batch):
                    loss, aux, grads = self.compute_gradients(model, batch)
                    grads = jax.tree.map(lambda g: jnp.clip(g, -0.1, 0.1), grads)
                    optimizer.update(model, grads, value=loss)
                    return loss, {**aux, "grad_norm": optax.tree.norm(grads)}
        """
        return step.apply_gradients(model, optimizer, *self.compute_gradients(model, batch))

    def compute_gradients(
        self, model: nnx.Module, batch: Any, loss_fn: LossFn | None = None
    ) -> tuple[jax.Array, dict[str, jax.Array], nnx.State]:
        """``(loss, aux, grads)`` of ``loss_fn`` (default ``self.loss_fn``) on ``batch``,
        with respect to the ``wrt`` parameters, over ``grad_accum_steps`` microbatches,
        checkpointed with the ``remat`` policy, the batch laid out as ``self.plan`` lays
        it out: inside a step, the plan the step is compiled for (a step for another
        plan runs on ``for_plan(plan)``, whose ``plan`` is that one)."""
        return self.plan.compute_gradients(model, batch, loss_fn or self.loss_fn)

    def eval_fn(self, model: nnx.Module, batch: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Evaluation loss and metrics inputs; defaults to ``loss_fn``."""
        return (self._eval_fn or self.loss_fn)(model, batch)

    def predict_fn(self, model: nnx.Module, batch: Any) -> Any:
        """The model's outputs for one batch, in eval mode; called inside the compiled
        predict step. Defaults to ``predict_fn=``, else ``model(batch["x"])``."""
        if self._predict_fn is not None:
            return self._predict_fn(model, batch)
        return model(predict.model_inputs(batch))

    def padded(self, batch: Any, *, divisor: int | None = None) -> Any:
        """``batch`` (a dict) with rows padded to a count the mesh can split, and a
        ``"mask"`` marking the padding (``data.pad_batch``).

        Evaluation pads a batch that needs it by itself; for training, ask for it:
        ``trainer.fit(map(trainer.padded, data))`` or ``dataset.map(trainer.padded)``.
        The metrics leave the padding out; the loss does when it averages with
        ``masked_mean(per_example_losses, batch)``. ``divisor`` defaults to
        ``grad_accum_steps``.
        """
        divisor = self.plan.grad_accum_steps if divisor is None else divisor
        return self.placement.padded(batch, divisor=divisor)

    def prepare_batch(self, batch: Any) -> Any:
        """A batch placed on the devices (laid out as ``self.plan`` lays it out), before the
        train step or the evaluation step reads it: called on the host, outside the compiled
        step, once per batch, by ``fit`` and ``evaluate``. The default returns it unchanged.

        Override it to add what the step reads and another compiled program computes, such
        as a frozen model's outputs (``post_training.DPOTrainer`` adds the reference model's
        log-probabilities here). Return the batch's keys with the same row layout: new
        leaves laid out as ``self.plan.batch_shardings`` lays out the returned batch.
        """
        return batch

    def initial_state(self) -> nnx.State:
        """The run's first state built anew, as step 0 held it: ``{"model", "optimizer"}``,
        from the factory and ``seed`` or from ``init_from``, every leaf born with the plan's
        sharding. The live state is untouched. For a frozen copy of the starting model
        beside the trained one (a reference model), the same on a fresh and a resumed run.
        A model given as a built module builds once: give a factory.
        """
        initial = self.run.initial_state
        return self.plan.materialize() if initial is None else initial(self.plan)

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
        holder = self._plan_holder
        if holder.pending is not None:
            train_data = auto.choose_on(train_data, holder.pending.auto.steps, self.choose_layout)
        first_logs, holder.first_logs = holder.first_logs, {}
        self._loop.fit(train_data, eval_data, max_steps, epochs, eval_every_n_steps, first_logs)
        return self.history

    def evaluate(self, eval_data: Iterable[Any]) -> dict[str, float]:
        """Runs ``eval_fn`` over all of ``eval_data``; returns ``{"loss": ..., ...}``."""
        logs = self._loop.evaluate(eval_data)
        return {key.removeprefix("eval/"): value for key, value in logs.items()}

    def predict(
        self,
        data: Iterable[Any],
        *,
        to_numpy: bool = False,
        predict_fn: Callable[[nnx.Module, Any], Any] | None = None,
    ) -> list[Any]:
        """``predict_fn``'s outputs for each batch of ``data``, in order.

        ``predict_fn`` (``(model, batch) -> outputs``) replaces the trainer's for this call:
        what an evaluation or a post-training loss reads besides the model's outputs
        (per-token log-probabilities, say). Keep one function object per purpose: each is
        compiled once per batch structure and kept in the plan's cache.

        A batch whose rows the mesh cannot split is padded, and its outputs are
        trimmed back to its rows (outputs then need the rows as their leading
        dimension). Outputs stay on the devices, laid out as the compiler chose,
        unless ``to_numpy``: then every process gets the whole of each as NumPy.

        Example::

            logits = trainer.predict(test_batches, to_numpy=True)  # [(rows, classes), ...]
        """
        return self._loop.predict(data, to_numpy=to_numpy, predict_fn=predict_fn)

    def ema_weights(self) -> contextlib.AbstractContextManager[None]:
        """Within the block the model holds the average of its weights (``Trainer(...,
        ema=EMA(...))``), and its trained weights again after: ``evaluate``, ``predict``,
        ``export`` and the model itself see the average. Do not ``fit`` inside it.

        Example::

            with trainer.ema_weights():
                results = trainer.evaluate(held_out)
                trainer.export("exported_ema")
        """
        return ema_lib.swapped_in(self.model, self.optimizer)

    def export(
        self,
        path: str | os.PathLike[str],
        *,
        overwrite: bool = False,
        weight_map: WeightMap | None = None,
    ) -> Path:
        """Writes the model's parameters where plain Orbax loads them (``export_params``),
        or, given a ``weight_map``, as the safetensors file it describes (the map
        ``init_from`` reads, run backwards: ``weights.save_safetensors``).

        ``orbax.checkpoint.PyTreeCheckpointer().restore(path)`` gives the
        model's tree of unsharded NumPy arrays, with no code of this library;
        ``safetensors.numpy.load_file(path)`` the file's tensors.
        """
        if weight_map is not None:
            return save_safetensors(self.model, path, weight_map, overwrite=overwrite)
        return export_params(self.model, path, overwrite=overwrite)
