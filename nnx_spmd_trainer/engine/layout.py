"""Layout: a trainer's plan and batch placement, given, or chosen by ``strategy="auto"``;
and ``LayoutAccess``, the ``Trainer``'s members that reach them."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import jax
import optax
from flax import nnx
from jax.sharding import Mesh

from nnx_spmd_trainer.data.placement import Placement
from nnx_spmd_trainer.engine import timing
from nnx_spmd_trainer.engine.callback import CallbackList
from nnx_spmd_trainer.engine.run import Run, not_chosen
from nnx_spmd_trainer.nn import remat as remat_lib
from nnx_spmd_trainer.planner import auto
from nnx_spmd_trainer.planner.backend_defaults import backend_default
from nnx_spmd_trainer.planner.plan import Plan
from nnx_spmd_trainer.planner.state import ModelFactory
from nnx_spmd_trainer.strategies import Strategy

_T = TypeVar("_T")

#: ``Plan`` settings a ``Trainer`` takes, with the value meaning "not given".
PLAN_SETTINGS: dict[str, Any] = {
    "optimizer": None,
    "strategy": None,
    "metrics": None,
    "seed": 0,
    "grad_accum_steps": 1,
    "wrt": nnx.Param,
    "devices": None,
    "donate": None,
    "remat": "none",
    "skip_nonfinite_updates": False,
}

#: ``strategy="auto"`` until the layout is chosen: its settings and the chooser.
Pending = tuple[auto.Auto, Callable[..., auto.Choice]]


def _given(name: str, value: Any) -> bool:
    default = PLAN_SETTINGS[name]
    return value is not default if default is None or name == "wrt" else value != default


def plan_or_chooser(
    model: ModelFactory | nnx.Module | Plan,
    optimizer: optax.GradientTransformation | None,
    strategy: Any,
    memory_budget_bytes: int | None,
    settings: dict[str, Any],
) -> tuple[Plan | None, Pending | None]:
    """The plan a ``Trainer``'s arguments describe, or, for ``strategy="auto"``, the
    chooser that makes one on real batches. ``settings``: the other ``Plan`` arguments."""
    if isinstance(model, Plan):
        given = {"optimizer": optimizer, "strategy": strategy, **settings}
        names = [k for k in PLAN_SETTINGS if _given(k, given[k])]
        if names:
            raise TypeError(
                f"Trainer(plan, ...) takes the layout from the plan; {', '.join(names)} "
                "belong to Plan(...). Give them there."
            )
        return model, None
    if optimizer is None:
        raise TypeError("Trainer needs an optimizer: Trainer(model, optax.adam(1e-3)).")
    auto_layout = auto.as_auto(strategy, memory_budget_bytes)
    if auto_layout is None:
        assert not isinstance(strategy, str | auto.Auto)
        return Plan(model, optimizer, strategy=strategy, **settings), None
    # Checked now, not as every candidate's failure in fit.
    platform = (settings["devices"] or jax.devices())[0].platform
    remat_lib.checkpoint_policy(settings["remat"], platform=platform)
    choose = functools.partial(
        auto.choose,
        model,
        optimizer,
        memory_budget_bytes=auto_layout.memory_budget_bytes,
        strategies=auto_layout.candidates,
        steps=auto_layout.steps,
        rounds=auto_layout.rounds,
        time_steps=timing.time_steps,  # auto ranks; the engine times
        **settings,
    )
    return None, (auto_layout, choose)


class Layout:
    """Where a trainer's run lives: the plan (the ``Run``'s), the batch placement, and,
    with ``strategy="auto"``, the choice still to make or the one made.

    Attributes:
      placement: batch placement on the plan's mesh; ``None`` until there is a plan.
      choice: with ``strategy="auto"``, the ranking and the layout chosen (``auto.Choice``).
      first_logs: the choice as logs, for the next ``fit``'s first ``on_logs``.
    """

    def __init__(
        self,
        run: Run,
        pending: Pending | None,
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
        settings, choose = self.pending
        choice = choose(batches, lower=lower, resume=resume)
        self.adopt(choice.plan)
        self.pending, self.choice, self.first_logs = None, choice, choice.logs()
        if settings.print_fn is not None:
            settings.print_fn(choice.table())
        return choice


class LayoutAccess:
    """The layout, through the trainer (a mixin of ``Trainer``): the plan, the placement,
    the mesh and strategy, which raise ``LayoutNotChosen`` while ``strategy="auto"`` has
    not chosen, and the choice (``choose_layout``, ``layout_choice``)."""

    if TYPE_CHECKING:  # the Trainer's; not annotations of the documented class
        run: Run
        _layout: Layout
        callbacks: CallbackList

        def train_step(
            self, model: nnx.Module, optimizer: nnx.Optimizer[nnx.Module], batch: Any
        ) -> tuple[jax.Array, dict[str, jax.Array]]: ...

    def _chosen(self, value: _T | None, name: str) -> _T:
        if value is None:
            raise not_chosen(name)
        return value

    @property
    def plan(self) -> Plan:
        """The layout and the compiled steps (``Plan``)."""
        return self._chosen(self.run.plan, "plan")

    @property
    def placement(self) -> Placement:
        """Batch placement (``Placement``)."""
        return self._chosen(self._layout.placement, "placement")

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
        if self._layout.pending is None:
            if self.layout_choice is not None:
                return self.layout_choice
            raise TypeError(
                f"choose_layout is for Trainer(strategy='auto'); this trainer's layout is "
                f"{self.strategy!r}."
            )
        # A resumed run keeps its layout; every process takes process 0's answer.
        resume = auto.agreed_text(self.callbacks.layout_to_resume())
        return self._layout.choose(batches, self._lower_candidate, resume)

    @property
    def layout_choice(self) -> auto.Choice | None:
        """With ``strategy="auto"``, the ranking and the layout chosen (``auto.Choice``)."""
        return self._layout.choice

    def _lower_candidate(self, plan: Plan, shapes: Any) -> jax.stages.Lowered:
        # compute_gradients reads the plan being traced (tracing_plan): the candidate's.
        return plan.lower(shapes, train_step=self.train_step)

    @property
    def mesh(self) -> Mesh:
        """The ``jax.sharding.Mesh`` the strategy built."""
        return self.plan.mesh

    @property
    def strategy(self) -> Strategy:
        """The strategy the plan lays the run out with."""
        return self.plan.strategy
