"""Prefetching and donation: measured defaults per backend, overridable, the same numbers."""

import jax
import optax
import pytest
from toy_models import Net, assert_params_match, classification_loss, make_batches, train_reference

from nnx_spmd_trainer import FSDP, Plan, Trainer
from nnx_spmd_trainer.planner.backend_defaults import MEASURED, ON_ACCELERATORS


def trainer(**options) -> Trainer:
    return Trainer(
        lambda r: Net(r), optax.adam(1e-2), strategy=FSDP(), loss_fn=classification_loss, **options
    )


def test_the_defaults_are_the_ones_measured_for_the_backend_and_overridable():
    measured = MEASURED.get(jax.devices()[0].platform, ON_ACCELERATORS)
    default = trainer()
    assert default.placement.prefetch == measured["prefetch"]
    assert default.plan.donate == measured["donate"]
    chosen = trainer(prefetch=3, donate=not measured["donate"])
    assert chosen.placement.prefetch == 3
    assert chosen.plan.donate == (not measured["donate"])


@pytest.mark.parametrize("donate", [True, False])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_every_setting_trains_to_the_plain_optax_numbers(prefetch, donate):
    batches = make_batches(4)
    run = trainer(prefetch=prefetch, donate=donate)
    before = jax.tree.leaves(run.state)
    run.fit(batches, max_steps=4)
    # Donated buffers were given to the steps; copied ones stay readable.
    assert [leaf.is_deleted() for leaf in before] == [donate] * len(before)
    reference, _ = train_reference(lambda r: Net(r), optax.adam(1e-2), batches)
    assert_params_match(run, reference)


def test_donation_belongs_to_the_plan():
    plan = Plan(lambda r: Net(r), optax.adam(1e-2), loss_fn=classification_loss, donate=True)
    assert Trainer(plan).plan.donate
    with pytest.raises(TypeError, match="donate belong to Plan"):
        Trainer(plan, donate=False)
