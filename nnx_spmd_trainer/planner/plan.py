"""Plan: what is known before any array of the state exists.

The mesh, the abstract state and its shardings, and the compiled steps come
from shapes alone, so a run can be planned (``plan.lower(shapes)``: memory
and cost analysis), and a checkpoint restored straight into the plan's
abstract targets, without ever building the initial state.

The plan binds a strategy to its mesh and is the one object that asks the
strategy: the initialiser, the step compiler and the batch placement ask the
plan (``state_shardings``, ``batch_shardings``, ``data_shard``,
``trace_context``, ``compile_step``). It holds the one cache of its compiled steps
(``cached_step``); a step is handed the plan it is compiled for (a ``Trainer``'s step, the
trainer bound to that plan: ``Trainer.for_plan``), so no plan is published while tracing.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
import optax
from clu import metrics as clu_metrics
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_spmd_trainer import sharding as sh
from nnx_spmd_trainer.data.batches import batch_kind
from nnx_spmd_trainer.nn import lora as lora_lib
from nnx_spmd_trainer.nn import lora_layout, tracing
from nnx_spmd_trainer.nn import remat as remat_lib
from nnx_spmd_trainer.nn.lora import LoRA
from nnx_spmd_trainer.optim import muon_layout
from nnx_spmd_trainer.optim.ema import EMA
from nnx_spmd_trainer.optim.spikes import SpikeSkip
from nnx_spmd_trainer.planner import flop_count, forward, plan_report, step
from nnx_spmd_trainer.planner.backend_defaults import backend_default
from nnx_spmd_trainer.planner.settings import DEFAULTS, PlanSettings
from nnx_spmd_trainer.planner.state import ModelFactory, leaf_shardings, model_builder
from nnx_spmd_trainer.planner.step_compiler import CachedStep, StepCache, step_spec
from nnx_spmd_trainer.planner.target import Target, is_target, resolve_devices
from nnx_spmd_trainer.strategies import DataParallel, Strategy

DefaultMetrics = clu_metrics.Collection.create(loss=clu_metrics.Average.from_output("loss"))


def tracing_plan() -> Plan | None:
    """Deprecated: always ``None``. A step is handed its plan (``Trainer.for_plan``); no
    plan is published while a step is traced."""
    warnings.warn(
        "tracing_plan() is deprecated and returns None: a step is handed the plan it is "
        "compiled for (a Trainer's step reads self.plan; see Trainer.for_plan).",
        DeprecationWarning,
        stacklevel=2,
    )
    return None


def wrapped_optimizer(
    optimizer: optax.GradientTransformation, ema: EMA | None, skip_spikes: SpikeSkip | None
) -> optax.GradientTransformation:
    """``optimizer`` inside the ``ema`` and ``skip_spikes`` wrappers asked for; spike
    skipping outermost, so a skipped step leaves the average alone too."""
    for name, wrapper, kind in (("ema", ema, EMA), ("skip_spikes", skip_spikes, SpikeSkip)):
        if wrapper is not None and not isinstance(wrapper, kind):
            raise TypeError(f"{name} must be a {kind.__name__}(...) or None, got {wrapper!r}.")
    if not isinstance(optimizer, optax.GradientTransformation):
        return optimizer  # model_builder names the mistake
    if ema is not None:
        optimizer = ema.wrap(optimizer)
    return skip_spikes.wrap(optimizer) if skip_spikes is not None else optimizer


def abstract_batch(batch: Any) -> Any:
    """Shapes and dtypes of a global batch (arrays, NumPy or ``jax.ShapeDtypeStruct``)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)


class Plan:
    """The layout and the steps of a run, before any array exists.

    Args:
      model: a factory ``rngs -> nnx.Module`` or an already-built ``nnx.Module``.
      optimizer: any optax ``GradientTransformation``.
      strategy: how state and batches are laid out; default ``DataParallel()``.
      loss_fn: ``(model, batch) -> (loss, aux)``, for the default train step.
      eval_fn: like ``loss_fn``, for evaluation; defaults to ``loss_fn``.
      metrics: a ``clu.metrics.Collection`` subclass; default: the average loss.
      seed: seeds ``nnx.Rngs`` given to the factory.
      grad_accum_steps: microbatches per step.
      wrt: an NNX filter of what trains (default every ``nnx.Param``).
      devices: the devices the mesh spans; default all of ``jax.devices()``. A
        ``Target`` or a TPU name (``"v5e-16"``, ``"v5p:4x4x4"``, ``"2xv5e-256"``) plans
        for chips that are not here: the TPU compiler's verdict, from this CPU
        (``planner.target``; nothing of such a plan can be materialised).
      donate: give the state's buffers to the train step, which writes the new
        state into them (one copy of the state on the devices); default: measured
        per backend (``backend_defaults``: on for accelerators and on the CPU, where
        turning it off never paid once the embeddings were laid out as XLA lays them).
      remat: the activation-checkpointing policy the whole ``loss_fn`` runs under, a
        name in ``remat.POLICIES`` (``"dots_saveable"``, ...): the backward pass
        recomputes what the policy does not save, with no change to the model.
        Default ``"none"``. Saving less of the whole loss is not always a lower
        peak: under ``"full"`` the forward pass is recomputed in one piece before
        the backward pass, so the peak is that of ``"none"``; checkpoint each block
        instead (``remat.remat``), where saving nothing pays.
      skip_nonfinite_updates: a train step whose loss or new parameters are not finite
        leaves the weights and the optimizer's state as they were (the step count and
        RNG state move on), as ``optax.apply_if_finite`` does; its loss still reaches
        the metrics and ``TerminateOnNaN``. Costs a check over the new parameters and
        a select over the state each step, with the updated state held in temporaries
        until the check is done: measured on the CPU with Adam and a small batch (a
        step mostly the optimizer's), 1.2-1.4x the step time and temporaries of about
        0.4x the state under ``DataParallel``, within noise and none under ``FSDP``.
        Default ``False``.
      ema: an ``EMA(decay=..., warmup=...)``: the optimizer's state also keeps an
        exponential moving average of the weights, updated in the step and laid out as
        the parameters are (``Trainer.ema_weights`` swaps it in). Default ``None``.
      skip_spikes: a ``SpikeSkip(z=..., window=...)``: a step whose loss or gradient
        norm is more than ``z`` standard deviations above the last ``window`` accepted
        steps' changes neither the weights nor the optimizer's state; the statistics
        live in the optimizer's state, the count in the logs (``train/skipped_spikes``).
        Default ``None``.
      lora: a ``LoRA(rank=..., targets=...)``: low-rank adapters are added to the target
        layers inside the sharded initialisation (after ``init_from``'s base is loaded),
        each laid out from its base layer (``nn.lora_layout``), and only they train
        (``wrt`` defaults to ``nnx.LoRAParam``; a ``wrt`` given is kept). Default ``None``.
      target: TPU chips to plan for in place of ``devices`` (a ``Target`` or its name).

    Attributes:
      strategy, mesh: the layout (ask the plan, not the strategy: ``batch_shardings``,
        ``trace_context``, ``compile_step``); ``data_shard``: the rows this process feeds.
      graphdef, abstract_state, shardings: the ``{"model", "optimizer"}`` state's
        structure, shapes (no arrays) and one ``NamedSharding`` per leaf.
      settings: the settings it was made with, as given (``PlanSettings``).

    Example::

        plan = Plan(lambda rngs: GPT(config, rngs=rngs), optax.adamw(3e-4),
                    strategy=Hybrid(FSDP(4), TensorParallel(2)), loss_fn=loss)
        batch = {"tokens": jax.ShapeDtypeStruct((32, 1024), jnp.int32)}
        print(plan.lower(batch).compile().memory_analysis())   # no array built
        trainer = Trainer(plan)                                 # the same layout, run
    """

    def __init__(
        self,
        model: ModelFactory | nnx.Module,
        optimizer: optax.GradientTransformation,
        *,
        strategy: Strategy | None = DEFAULTS.strategy,
        loss_fn: step.LossFn | None = None,
        eval_fn: step.LossFn | None = None,
        metrics: type[clu_metrics.Collection] | None = DEFAULTS.metrics,
        seed: int = DEFAULTS.seed,
        grad_accum_steps: int = DEFAULTS.grad_accum_steps,
        wrt: nnx.filterlib.Filter = DEFAULTS.wrt,
        devices: Sequence[jax.Device] | None = DEFAULTS.devices,
        donate: bool | None = DEFAULTS.donate,
        remat: str = DEFAULTS.remat,
        skip_nonfinite_updates: bool = DEFAULTS.skip_nonfinite_updates,
        ema: EMA | None = DEFAULTS.ema,
        skip_spikes: SpikeSkip | None = DEFAULTS.skip_spikes,
        lora: LoRA | None = DEFAULTS.lora,
        target: Target | str | None = None,
    ) -> None:
        devices = resolve_devices(devices if target is None else target)  # a Target's chips
        self.settings = PlanSettings.of(locals())  # the thirteen keywords, as given
        if grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps must be >= 1, got {grad_accum_steps}.")
        self.strategy = strategy if strategy is not None else DataParallel()
        self.mesh = self.strategy.make_mesh(devices)
        self.remat = remat
        platform = self.mesh.devices.flat[0].platform
        self._checkpoint = remat_lib.checkpoint_policy(remat, platform=platform)
        # A Target's chips are compiled for, never fed: no host here reads their rows.
        chips = is_target(list(self.mesh.devices.flat[:1]))
        fed = np.zeros(self.mesh.devices.shape, int) if chips else None
        self.data_shard = self.strategy.data_shard(self.mesh, process_ids=fed)
        self.optimizer = optimizer
        self.loss_fn, self.eval_fn = loss_fn, eval_fn
        self.metrics_class = metrics if metrics is not None else DefaultMetrics
        self.grad_accum_steps, self.wrt = grad_accum_steps, wrt
        self._batch_shardings: dict[Any, Any] = {}
        tx = wrapped_optimizer(optimizer, ema, skip_spikes)
        adapt = None
        if lora is not None:
            if not isinstance(lora, LoRA):
                raise TypeError(
                    f"lora must be a LoRA(rank=..., targets=...) or None, got {lora!r}."
                )
            wrt = wrt if "wrt" in self.settings.given() else nnx.LoRAParam
            self.wrt, adapt = wrt, lora_lib.initializer(lora, seed, trained=wrt)
        self.lora = lora
        self._init = model_builder(
            model, tx, self.state_shardings, self.mesh, seed, wrt, transform=adapt
        )
        self.graphdef = self._init.graphdef
        self.abstract_state = self._init.abstract_state
        self.shardings = self._init.shardings
        self.treedef = jax.tree.structure(self.abstract_state)
        #: The train step's state and metrics buffers given to its outputs.
        self.donate = backend_default("donate", self.mesh) if donate is None else donate
        self.skip_nonfinite_updates = skip_nonfinite_updates
        #: The one cache of this plan's compiled steps (``cached_step``).
        self.steps = StepCache()

    # -- the strategy's answers, on this plan's mesh ------------------------------------
    def state_shardings(self, abstract_state: nnx.State) -> Any:
        """A ``NamedSharding`` per leaf of ``abstract_state``: the strategy's answer, with
        LoRA adapters laid out from their base layers' (``nn.lora_layout.follow_bases``)."""
        answer = self.strategy.state_shardings(abstract_state, self.mesh)
        return lora_layout.follow_bases(abstract_state, answer)

    def batch_shardings(self, batch: Any) -> Any:
        """A ``NamedSharding`` per leaf of batches like ``batch`` (arrays, tracers or
        ``jax.ShapeDtypeStruct`` s): the strategy's answer, asked once per tree
        structure, shapes and dtypes."""
        key = batch_kind(batch)
        shardings = self._batch_shardings.get(key)
        if shardings is None:
            shardings = self._batch_shardings[key] = self.strategy.batch_sharding(batch, self.mesh)
        return shardings

    @contextlib.contextmanager
    def trace_context(self, batch_shardings: Any = None) -> Iterator[None]:
        """What is in force while a step is traced: the strategy's ``trace_context``; with
        the ``batch_shardings``, a ``batch`` rule naming the mesh axes that split the rows
        (``nn.tracing.tracing_rules``), for a layer that routes rows itself (the dropless
        MoE's ``shard_map``, manual over them: each device routes only its own rows)."""
        split = [  # the rows' axes: of the first leaf whose rows are split
            axes
            for s in jax.tree.leaves(batch_shardings)
            if isinstance(s, NamedSharding) and (axes := sh.dimension_axes(s.spec, 1)[0])
        ]
        rows: sh.Rules = (("batch", split[0]),) if split else ()
        with (
            self.strategy.trace_context(self.mesh),
            tracing.tracing_rules(rows),
            muon_layout.parameter_layout(self.shardings["model"]),  # Muon's matrix owners
        ):
            yield

    def compile_step(
        self,
        step_fn: Callable[..., Any],
        *,
        batch: Any,
        out_shardings: Any,
        donate_argnums: tuple[int, ...] = (),
    ) -> Callable[..., Any]:
        """``step_fn(state_arrays, metrics, batch)`` jitted as the strategy compiles it:
        wrapped by its ``transform_step``, traced inside ``trace_context`` (given the
        batch's shardings), with the state in this plan's shardings, the metrics
        replicated and the batch in ``batch_shardings(batch)``."""
        batch_shardings = self.batch_shardings(batch)
        wrapped = step.traced_within(
            self.strategy.transform_step(step_fn),
            functools.partial(self.trace_context, batch_shardings),
        )
        return self.strategy.compile_step(
            wrapped,
            in_shardings=(self.leaf_shardings, self.replicated, batch_shardings),
            out_shardings=out_shardings,
            donate_argnums=donate_argnums,
        )

    def axis_roles(self) -> dict[str, str]:
        """What each mesh axis carries (``"data"``, ``"model"``, ``"stage"``, ...): the
        strategy's answer (``Strategy.axis_roles``)."""
        return self.strategy.axis_roles()

    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes that split a batch's rows: the strategy's answer."""
        return tuple(self.strategy.batch_axes())

    def compile_program(
        self, fn: Callable[..., Any], *, donate_argnums: tuple[int, ...] = (), **layout: Any
    ) -> Callable[..., Any]:
        """``fn`` of any arguments (not a train step's: the sampler's prefill and decode)
        jitted as the strategy compiles its steps, with the ``in_shardings`` and
        ``out_shardings`` given; ``fn`` enters ``trace_context`` itself, if it wants it."""
        return self.strategy.compile_step(fn, donate_argnums=donate_argnums, **layout)

    @functools.cached_property
    def leaf_shardings(self) -> list[NamedSharding]:
        """The sharding of each array leaf of the state, in ``jax.tree.leaves`` order."""
        return leaf_shardings(self.shardings, self.abstract_state)

    def state_targets(self) -> nnx.State:
        """The state as ``jax.ShapeDtypeStruct`` s with this plan's shardings: what a
        checkpoint restores into (Orbax ``StandardRestore``), with no array built."""
        leaves = jax.tree.leaves(self.abstract_state)
        targets = [
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
            for x, s in zip(leaves, self.leaf_shardings, strict=True)
        ]
        return jax.tree.unflatten(self.treedef, targets)

    def materialize(self, params: nnx.State | None = None) -> nnx.State:
        """Builds the initial state under jit, every leaf born with its sharding.

        With ``params`` (the model's ``nnx.Param`` arrays, laid out as this plan lays
        them out: ``weights.load_weights``), the model holds those, donated, and the
        optimizer's state is made from them; the random parameters they replace are
        never built. Once: a pre-built module's arrays are donated to it.
        """
        return self._init(params)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    @functools.cached_property
    def _make_empty_metrics(self) -> Callable[[], clu_metrics.Collection]:
        # One dispatch making the zeros on every device: a device_put of the host
        # collection costs ~6x more, and a fit makes two (benchmarks/trainer_overhead.py).
        return jax.jit(self.metrics_class.empty, out_shardings=self.replicated)

    def empty_metrics(self) -> clu_metrics.Collection:
        """A fresh metrics collection, replicated on the mesh; on a ``Target``'s chips,
        where no array can be, its shapes (a plan for them is compiled, never run)."""
        if is_target(list(self.mesh.devices.flat[:1])):
            return jax.eval_shape(self.metrics_class.empty)  # type: ignore[no-any-return]
        return self._make_empty_metrics()

    # -- the steps -------------------------------------------------------------------
    def compute_gradients(
        self, model: nnx.Module, batch: Any, loss_fn: step.LossFn | None = None
    ) -> tuple[jax.Array, dict[str, jax.Array], nnx.State]:
        """``(loss, aux, grads)`` of ``loss_fn`` (default the plan's) over the microbatches,
        checkpointed with the plan's ``remat`` policy."""
        loss_fn = loss_fn or self.loss_fn
        if loss_fn is None:
            raise TypeError("This plan has no loss: give Plan(..., loss_fn=...).")
        return step.compute_gradients(
            model,
            batch,
            loss_fn,
            wrt=self.wrt,
            grad_accum_steps=self.grad_accum_steps,
            batch_sharding=self.batch_shardings(batch),
            checkpoint=self._checkpoint,
        )

    def train_step(
        self, model: nnx.Module, optimizer: nnx.Optimizer[nnx.Module], batch: Any
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The default train step: gradients of ``loss_fn``, one optimizer update."""
        return step.apply_gradients(model, optimizer, *self.compute_gradients(model, batch))

    def compiled(
        self,
        kind: str,
        batch: Any,
        *,
        fn: Callable[..., Any] | None = None,
        norms: bool = False,
        graphdef: nnx.GraphDef[Any] | None = None,
        treedef: Any = None,
    ) -> Callable[..., Any]:
        """The jitted train (``kind="train"``) or eval step for batches like ``batch``.

        ``fn`` is the train step (default ``self.train_step``) or the eval function
        (default ``eval_fn``, else ``loss_fn``); ``graphdef``/``treedef`` those of
        the live objects when they were edited since (default the plan's).
        """
        return self.cached_step(
            kind, batch, fn=fn, norms=norms, graphdef=graphdef, treedef=treedef
        ).fn

    def cached_step(
        self,
        kind: str,
        batch: Any,
        *,
        fn: Callable[..., Any] | None = None,
        norms: bool = False,
        graphdef: nnx.GraphDef[Any] | None = None,
        treedef: Any = None,
    ) -> CachedStep:
        """``compiled``'s step from the plan's one cache (``steps``), and whether this
        call compiled it (``CachedStep.new``: its first call traces and compiles)."""
        if fn is None:
            fn = self.train_step if kind == "train" else (self.eval_fn or self.loss_fn)
        if fn is None:
            raise TypeError("This plan has no loss: give Plan(..., loss_fn=...).")
        graphdef = self.graphdef if graphdef is None else graphdef
        key = self._step_key(kind, batch, fn, norms, graphdef)

        def build() -> Callable[..., Any]:
            spec = step_spec(
                kind,
                graphdef=graphdef,
                treedef=self.treedef if treedef is None else treedef,
                fn=fn,
                wrt=self.wrt,
                norms=norms,
                skip_nonfinite=self.skip_nonfinite_updates,
                donate=self.donate,
                state_shardings=self.leaf_shardings,
                replicated=self.replicated,
            )
            return self.compile_step(
                spec.fn,
                batch=batch,
                out_shardings=spec.out_shardings,
                donate_argnums=spec.donate_argnums,
            )

        return self.steps.get(key, build)

    def _step_key(
        self, kind: str, batch: Any, fn: Any, norms: bool, graphdef: nnx.GraphDef[Any]
    ) -> tuple[Any, ...]:
        # grad_accum_steps: read by ``fn`` at trace time.
        structure = jax.tree.structure(batch)
        return (kind, norms, self.steps.graph_id(graphdef), structure, fn, self.grad_accum_steps)

    def put_step(
        self, kind: str, batch: Any, step: Callable[..., Any], *, fn: Any, norms: bool
    ) -> None:
        """Puts ``step`` in the cache as ``cached_step(kind, batch, fn=fn, norms=norms)``'s
        own (a saved step loaded: ``saved_step.load_step``)."""
        self.steps.put(self._step_key(kind, batch, fn, norms, self.graphdef), step)

    def lower(
        self, batch: Any, *, train_step: Callable[..., Any] | None = None, norms: bool = False
    ) -> jax.stages.Lowered:
        """``jax.jit(...).lower`` of the train step from shapes alone: no state array is
        built. ``batch`` is the global batch, as arrays or ``jax.ShapeDtypeStruct`` s;
        ``train_step`` a trainer's (default the plan's). ``.compile().memory_analysis()``
        says what a device will hold before anything is allocated."""
        jitted, args = self.step_and_arguments(batch, train_step=train_step, norms=norms)
        with jax.set_mesh(self.mesh):
            return jitted.lower(*args)  # type: ignore[no-any-return]

    def step_and_arguments(
        self, batch: Any, *, train_step: Callable[..., Any] | None = None, norms: bool = False
    ) -> tuple[Any, tuple[Any, ...]]:
        """The jitted train step for ``batch`` (global shapes) and its arguments as
        shapes laid out as the step takes them: the state's leaves, the metrics, the
        batch."""
        shapes = abstract_batch(batch)
        jitted: Any = self.compiled("train", shapes, fn=train_step, norms=norms)
        placed = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            shapes,
            self.batch_shardings(shapes),
        )
        metrics = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.replicated),
            jax.eval_shape(self.metrics_class.empty),
        )
        return jitted, (jax.tree.leaves(self.state_targets()), metrics, placed)

    def forward_program(
        self,
        fn: Callable[[nnx.Module, Any], Any],
        graphdef: nnx.GraphDef[Any],
        state: Any,
        batch: Any,
        **options: Any,
    ) -> Callable[[Any, Any], Any]:
        """``program(state, batch) -> fn(model, batch)``: a forward-only program on this
        plan's layout, compiled once per function, graph, state layout and batch shapes
        and kept in ``steps`` (``planner.forward.forward_program`` says how; ``options``:
        ``enter``, ``out_shardings``)."""
        return forward.forward_program(self, fn, graphdef, state, batch, **options)

    def report(
        self,
        batch: Any,
        *,
        memory_budget_bytes: int | None = None,
        train_step: Callable[..., Any] | None = None,
        notes: str | Sequence[str | None] = (),
    ) -> plan_report.PlanReport:
        """What the train step on ``batch`` (global shapes) costs per device, from the
        compiler alone: state bytes per leaf, the compiled memory and whether it fits
        (``memory_budget_bytes``, else the device's limit), collectives, FLOPs.
        No array is built and no step runs; ``print(plan.report(shapes))``. ``notes``:
        lines printed with it (``None`` left out), as ``PlanReport.notes``."""
        jitted, args = self.step_and_arguments(batch, train_step=train_step)
        trace = getattr(jitted, "trace", None)  # a strategy's own wrapper may not trace
        with jax.set_mesh(self.mesh):
            traced = trace(*args) if trace is not None else None
            lowered = traced.lower() if traced is not None else jitted.lower(*args)
        # The FLOPs the step's matrix multiplies do, every scanned layer counted (XLA's
        # cost analysis counts a loop's body once).
        matmuls = None if traced is None else flop_count.matmul_flops(traced.jaxpr)
        report = plan_report.compiled_report(  # a compiler's refusal: a verdict
            self, lowered, memory_budget_bytes=memory_budget_bytes,
            matmul_flops=None if not matmuls else matmuls / self.mesh.size,
        )  # fmt: skip
        lines: Sequence[str | None] = (notes,) if isinstance(notes, str) else notes
        report.notes.extend(note for note in lines if note)  # one string: one note
        return report
