"""Layout: a trainer's plan and batch placement, given, or chosen by ``strategy="auto"``."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import jax
import optax
from flax import nnx

from nnx_spmd_trainer import auto
from nnx_spmd_trainer import remat as remat_lib
from nnx_spmd_trainer.backend_defaults import backend_default
from nnx_spmd_trainer.placement import Placement
from nnx_spmd_trainer.plan import Plan
from nnx_spmd_trainer.report import MetricsReport
from nnx_spmd_trainer.run import Run
from nnx_spmd_trainer.state import ModelFactory

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
        track_norms: bool,
        log_every_n_steps: int | None,
    ) -> None:
        self.run, self.pending = run, pending
        self.placement: Placement | None = None
        self.choice: auto.Choice | None = None
        self.first_logs: dict[str, float] = {}
        self._settings = (prefetch, max_steps_in_flight, track_norms, log_every_n_steps)

    def adopt(self, plan: Plan) -> None:
        """Makes ``plan`` the run's, with its placement and a metrics report for it (the
        log schedule asked so far kept)."""
        prefetch, max_steps_in_flight, track_norms, log_every_n_steps = self._settings
        self.run.plan = plan
        self.placement = Placement(
            plan.strategy,
            plan.mesh,
            plan.data_shard,
            prefetch=backend_default("prefetch", plan.mesh) if prefetch is None else prefetch,
            max_steps_in_flight=max_steps_in_flight,
        )
        asked = self.run.report.log_every
        self.run.report = MetricsReport(
            plan.empty_metrics, plan.mesh.local_devices, track_norms=track_norms
        )
        for n in (*asked, *([log_every_n_steps] if log_every_n_steps is not None else [])):
            self.run.report.request_log_every(n)

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
        if settings.report is not None:
            settings.report(choice.table())
        return choice
