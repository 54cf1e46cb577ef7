"""The trainer's plan holder: ``PlanHolder``, which holds a trainer's plan and batch
placement, given or chosen by ``strategy="auto"``; and ``LayoutAccess``, the ``Trainer``'s
members that reach them.

"Layout" is the public concept: how the state and the batches are laid out on the
devices (a strategy on a mesh, what a ``Plan`` binds; ``choose_layout``,
``layout_choice``, ``LayoutNotChosen``). The holder holds a plan, which has one. (This
module was ``engine/layout.py``; the old path imports it, with a ``DeprecationWarning``.)
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple, Self, TypeVar

import jax
from flax import nnx
from jax.sharding import Mesh

from nnx_spmd_trainer import deprecation
from nnx_spmd_trainer.data.placement import Placement
from nnx_spmd_trainer.engine import timing
from nnx_spmd_trainer.engine.hooks import CallbackList
from nnx_spmd_trainer.engine.run import Run, not_chosen
from nnx_spmd_trainer.nn import remat as remat_lib
from nnx_spmd_trainer.planner import auto
from nnx_spmd_trainer.planner.backend_defaults import backend_default
from nnx_spmd_trainer.planner.plan import Plan
from nnx_spmd_trainer.planner.settings import PlanSettings
from nnx_spmd_trainer.planner.state import ModelFactory
from nnx_spmd_trainer.planner.step import LossFn
from nnx_spmd_trainer.strategies import Strategy

_T = TypeVar("_T")


class PendingChoice(NamedTuple):
    """``strategy="auto"`` until the layout is chosen.

    Attributes:
      auto: what was asked (``auto.Auto``: the candidates, the steps timed, ``print_fn``).
      choose: ``auto.choose`` bound to the trainer's model and settings:
        ``choose(batches, lower=..., resume=...) -> auto.Choice``.
    """

    auto: auto.Auto
    choose: Callable[..., auto.Choice]


def plan_or_chooser(
    model: ModelFactory | nnx.Module | Plan,
    settings: PlanSettings,
    *,
    loss_fn: LossFn | None,
    eval_fn: LossFn | None,
    memory_budget_bytes: int | None,
) -> tuple[Plan | None, PendingChoice | None]:
    """The plan a ``Trainer``'s arguments describe, or, for ``strategy="auto"``
    (``settings.strategy``), the chooser that makes one on real batches."""
    if isinstance(model, Plan):
        names = settings.given()
        if names:
            raise TypeError(
                f"Trainer(plan, ...) takes the layout from the plan; {', '.join(names)} "
                "belong to Plan(...). Give them there."
            )
        return model, None
    optimizer, strategy = settings.optimizer, settings.strategy
    if optimizer is None:
        raise TypeError("Trainer needs an optimizer: Trainer(model, optax.adam(1e-3)).")
    kwargs = {
        **settings.as_kwargs(without=("optimizer", "strategy")),
        "loss_fn": loss_fn,
        "eval_fn": eval_fn,
    }
    auto_layout = auto.as_auto(strategy, memory_budget_bytes)
    if auto_layout is None:
        assert not isinstance(strategy, str | auto.Auto)
        return Plan(model, optimizer, strategy=strategy, **kwargs), None
    # Checked now, not as every candidate's failure in fit.
    platform = (settings.devices or jax.devices())[0].platform
    remat_lib.checkpoint_policy(settings.remat, platform=platform)
    choose = functools.partial(
        auto.choose,
        model,
        optimizer,
        memory_budget_bytes=auto_layout.memory_budget_bytes,
        strategies=auto_layout.candidates,
        steps=auto_layout.steps,
        rounds=auto_layout.rounds,
        time_steps=timing.time_steps,  # auto ranks; the engine times
        **kwargs,
    )
    return None, PendingChoice(auto_layout, choose)


class PlanHolder:
    """Holds a trainer's plan (set on the ``Run``) and the batch placement made for it:
    the plan given to the ``Trainer``, or, with ``strategy="auto"``, the choice still to
    make (``pending``) and then the one made. (It was ``Layout``; it holds a plan, whose
    strategy and mesh are the layout.)

    Attributes:
      pending: with ``strategy="auto"`` until the choice, what is to be chosen
        (``PendingChoice``); else ``None``.
      placement: batch placement on the plan's mesh; ``None`` until there is a plan.
      choice: with ``strategy="auto"``, the ranking and the layout chosen (``auto.Choice``).
      first_logs: the choice as logs, for the next ``fit``'s first ``on_logs``.
    """

    def __init__(
        self,
        run: Run,
        pending: PendingChoice | None,
        *,
        prefetch: int | None,
        max_steps_in_flight: int,
    ) -> None:
        self.run, self.pending = run, pending
        self.placement: Placement | None = None
        self.choice: auto.Choice | None = None
        self.first_logs: dict[str, float] = {}
        self._settings = (prefetch, max_steps_in_flight)

    def adopt(self, plan: Plan) -> None:
        """Makes ``plan`` the run's (which gives it the plan's metric accumulators), with
        its placement."""
        prefetch, max_steps_in_flight = self._settings
        self.run.plan = plan
        self.placement = Placement(
            plan,
            prefetch=backend_default("prefetch", plan.mesh) if prefetch is None else prefetch,
            max_steps_in_flight=max_steps_in_flight,
        )

    def choose(
        self,
        batches: Iterable[Any],
        lower: Callable[[Plan, Any], jax.stages.Lowered],
        resume: str | None,
    ) -> auto.Choice:
        """Times the pending candidates on ``batches`` and adopts the fastest
        (``resume``: the layout a resumed run keeps, untimed)."""
        assert self.pending is not None
        choice = self.pending.choose(batches, lower=lower, resume=resume)
        print_fn = self.pending.auto.print_fn
        self.adopt(choice.plan)
        self.pending, self.choice, self.first_logs = None, choice, choice.logs()
        if print_fn is not None:
            print_fn(choice.table())
        return choice


def __getattr__(name: str) -> Any:
    if name == "Layout":  # its 0.1 name
        deprecation.warn_renamed("engine.layout.Layout", "engine.plan_holder.PlanHolder")
        return PlanHolder
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class LayoutAccess:
    """The layout, through the trainer (a mixin of ``Trainer``): the plan, the placement,
    the mesh and strategy, which raise ``LayoutNotChosen`` while ``strategy="auto"`` has
    not chosen, and the choice (``choose_layout``, ``layout_choice``)."""

    if TYPE_CHECKING:  # the Trainer's; not annotations of the documented class
        run: Run
        _plan_holder: PlanHolder
        callbacks: CallbackList

        def train_step(
            self, model: nnx.Module, optimizer: nnx.Optimizer[nnx.Module], batch: Any
        ) -> tuple[jax.Array, dict[str, jax.Array]]: ...

    #: The plan of a trainer bound to one (``for_plan``); ``None``: the run's plan.
    _bound_plan: Plan | None = None

    def _chosen(self, value: _T | None, name: str) -> _T:
        if value is None:
            raise not_chosen(name)
        return value

    @property
    def plan(self) -> Plan:
        """The layout and the compiled steps (``Plan``)."""
        if self._bound_plan is not None:
            return self._bound_plan
        return self._chosen(self.run.plan, "plan")

    def for_plan(self, plan: Plan) -> Self:
        """This trainer as a step compiled for ``plan`` sees it: a shallow copy whose
        ``plan`` (so ``mesh``, ``strategy`` and the layout ``compute_gradients`` lays the
        batch out with) is ``plan``, sharing the run and everything else.

        A step is handed its plan this way: ``strategy="auto"`` lowers each candidate's
        step with ``trainer.for_plan(candidate).train_step``, and the trainer's run is
        untouched. Lowering another plan's step with this trainer's overrides::

            plan.lower(shapes, train_step=trainer.for_plan(plan).train_step)
        """
        bound = copy.copy(self)
        bound._bound_plan = plan
        return bound

    @property
    def placement(self) -> Placement:
        """Batch placement (``Placement``)."""
        return self._chosen(self._plan_holder.placement, "placement")

    def choose_layout(self, batches: Iterable[Any]) -> auto.Choice:
        """``strategy="auto"``: plans every layout the devices allow, times those that fit
        on the first batches of ``batches`` and keeps the fastest (``auto.choose``).

        The ranking is printed (``Auto.print_fn``), kept in ``layout_choice`` and put in
        the next ``fit``'s first logs (``layout/...``); no candidate's arrays stay on the
        devices, and the state is then built as for the chosen strategy given
        explicitly. ``fit`` calls this with its first batches when it was not called.
        A run about to be resumed (a callback's ``layout_to_resume``, e.g. an
        ``OrbaxCheckpoint`` holding steps) keeps the layout it ran in, untimed, where
        that layout is a candidate and still fits.
        """
        if self._plan_holder.pending is None:
            if self.layout_choice is not None:
                return self.layout_choice
            raise TypeError(
                f"choose_layout is for Trainer(strategy='auto'); this trainer's layout is "
                f"{self.strategy!r}."
            )
        # A resumed run keeps its layout; every process takes process 0's answer.
        resume = auto.agreed_text(self.callbacks.layout_to_resume())
        return self._plan_holder.choose(batches, self._lower_candidate, resume)

    @property
    def layout_choice(self) -> auto.Choice | None:
        """With ``strategy="auto"``, the ranking and the layout chosen (``auto.Choice``)."""
        return self._plan_holder.choice

    def _lower_candidate(self, plan: Plan, shapes: Any) -> jax.stages.Lowered:
        # The candidate's step is handed the candidate's plan, not the run's.
        return plan.lower(shapes, train_step=self.for_plan(plan).train_step)

    @property
    def mesh(self) -> Mesh:
        """The ``jax.sharding.Mesh`` the strategy built."""
        return self.plan.mesh

    @property
    def strategy(self) -> Strategy:
        """The strategy the plan lays the run out with."""
        return self.plan.strategy
