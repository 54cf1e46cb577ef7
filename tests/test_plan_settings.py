"""Issue 38, knots 1, 2 and 4: the Plan's settings written once, the step handed its plan,
one compile cache that says whether a lookup compiled."""

from __future__ import annotations

import copy
import dataclasses
import inspect

import optax
import pytest
from flax import nnx
from toy_models import Net, classification_loss, make_batches

from nnx_spmd_trainer import FSDP, DataParallel, LayoutNotChosen, Plan, Trainer
from nnx_spmd_trainer.engine.run import Run
from nnx_spmd_trainer.planner.plan import abstract_batch
from nnx_spmd_trainer.planner.settings import DEFAULTS, PlanSettings


def test_plan_and_trainer_take_the_settings_defaults():
    names = [f.name for f in dataclasses.fields(PlanSettings)]
    assert len(names) == 13
    for signature in (inspect.signature(Plan), inspect.signature(Trainer)):
        for name in names:
            if name != "optimizer":  # Plan's is required
                assert signature.parameters[name].default is getattr(DEFAULTS, name), name
    plan = Plan(Net, optax.sgd(0.1), loss_fn=classification_loss, seed=3, wrt=nnx.Param)
    assert plan.settings.seed == 3 and plan.settings.given() == ["optimizer", "seed"]


def test_plan_and_trainer_gather_their_settings_by_name_in_one_place():
    tx = optax.sgd(0.1)
    trainer = Trainer(Net, tx, loss_fn=classification_loss, seed=3, grad_accum_steps=2)
    assert trainer.plan.settings == PlanSettings(optimizer=tx, seed=3, grad_accum_steps=2)
    arguments = {**DEFAULTS.as_kwargs(without=("ema", "skip_spikes")), "model": Net}
    with pytest.raises(TypeError, match=r"^PlanSettings\.of: no ema, skip_spikes among"):
        PlanSettings.of(arguments)


def test_a_trainer_on_a_plan_names_exactly_the_settings_given_beside_it():
    plan = Plan(Net, optax.sgd(0.1), loss_fn=classification_loss)
    Trainer(plan, seed=0, wrt=nnx.Param, remat="none")  # the defaults: nothing given
    with pytest.raises(TypeError, match=r"; seed, wrt, skip_nonfinite_updates belong to Plan"):
        Trainer(plan, seed=1, wrt=nnx.All(nnx.Param), skip_nonfinite_updates=True)


def test_the_plans_cache_says_which_lookup_compiled():
    plan = Plan(Net, optax.sgd(0.1), loss_fn=classification_loss)
    shapes = abstract_batch(make_batches(1)[0])
    first = plan.cached_step("train", shapes)
    assert first.new and plan.steps.count == 1
    again = plan.cached_step("train", shapes)
    assert not again.new and again.fn is first.fn
    # An equal graph in another object finds the same step (a new fit splits the model anew).
    equal_graph = copy.deepcopy(plan.graphdef)
    assert equal_graph == plan.graphdef and equal_graph is not plan.graphdef
    assert plan.cached_step("train", shapes, graphdef=equal_graph).fn is first.fn
    norms = plan.cached_step("train", shapes, norms=True)
    assert norms.new and norms.fn is not first.fn and plan.steps.count == 2
    assert plan.compiled("train", shapes, norms=True) is norms.fn


def test_a_step_compiled_for_another_plan_is_handed_that_plan():
    seen = []

    class Recording(Trainer):
        def train_step(self, model, optimizer, batch):
            seen.append(self.plan)
            return super().train_step(model, optimizer, batch)

    trainer = Recording(Net, optax.sgd(0.1), loss_fn=classification_loss)
    other = Plan(Net, optax.sgd(0.1), strategy=FSDP(min_size=64), loss_fn=classification_loss)
    shapes = abstract_batch(make_batches(1)[0])
    other.lower(shapes, train_step=trainer.for_plan(other).train_step)
    assert seen == [other]  # traced once, with the plan it is compiled for
    assert trainer.plan.strategy == DataParallel() and trainer.for_plan(other).run is trainer.run


def test_an_unchosen_plan_names_what_was_asked():
    trainer = Trainer(Net, optax.sgd(0.1), loss_fn=classification_loss, strategy="auto")
    for asked in ("model", "optimizer", "state"):
        with pytest.raises(LayoutNotChosen, match=rf"^trainer\.{asked}:"):
            getattr(trainer, asked)
    with pytest.raises(LayoutNotChosen, match=r"^trainer\.run_state:"):
        Run().chosen_plan("run_state")
    with pytest.warns(DeprecationWarning, match="chosen_plan"), pytest.raises(LayoutNotChosen):
        Run().layout()


def test_the_old_names_warn_and_work():
    from nnx_spmd_trainer.engine import plan_holder
    from nnx_spmd_trainer.planner.plan import tracing_plan

    with pytest.warns(DeprecationWarning, match="PlanHolder"):
        assert plan_holder.Layout is plan_holder.PlanHolder
    with pytest.warns(DeprecationWarning, match="handed the plan"):
        assert tracing_plan() is None
