"""A subclass overrides the public train_step: gradients in hand, against plain optax."""

import jax
import numpy as np
import optax
import pytest
from clu import metrics as clu_metrics
from flax import nnx
from toy_models import Net, assert_params_match, classification_loss, make_batches, train_reference

from nnx_spmd_trainer import FSDP, DataParallel, Hybrid, TensorParallel, Trainer
from nnx_spmd_trainer.callbacks import MetricsLogger

Metrics = clu_metrics.Collection.create(
    loss=clu_metrics.Average.from_output("loss"),
    grad_norm=clu_metrics.Average.from_output("grad_norm"),
)


class HalfGradients(Trainer):
    """Research code: halves the gradients by hand and logs their norm."""

    def loss_fn(self, model, batch):
        return classification_loss(model, batch)

    def train_step(self, model, optimizer, batch):
        loss, aux, grads = self.compute_gradients(model, batch)
        grads = jax.tree.map(lambda g: 0.5 * g, grads)
        optimizer.update(model, grads, value=loss)
        return loss, {**aux, "grad_norm": optax.tree.norm(grads)}


@pytest.mark.parametrize(
    "strategy, accumulate",
    [(DataParallel(), 1), (FSDP(min_size=64), 1),
     (Hybrid(FSDP(4, min_size=64), TensorParallel(2)), 1),
     (Hybrid(FSDP(4, min_size=64), TensorParallel(2)), 2)],
    ids=["dp", "fsdp", "fsdp4xtp2", "fsdp4xtp2-accumulated"],
)  # fmt: skip
def test_an_overridden_step_equals_the_same_rule_in_plain_optax(strategy, accumulate):
    batches = make_batches(3, batch_size=32)
    trainer = HalfGradients(
        lambda r: Net(r), optax.adam(1e-2), strategy=strategy, metrics=Metrics,
        grad_accum_steps=accumulate, callbacks=[MetricsLogger(1)],
    )  # fmt: skip
    history = trainer.fit(batches, max_steps=3)
    reference, losses = train_reference(
        lambda r: Net(r), optax.chain(optax.scale(0.5), optax.adam(1e-2)), batches
    )
    assert_params_match(trainer, reference)
    np.testing.assert_allclose(history.history["train/loss"], losses, rtol=1e-5)

    # The norm logged at step 1: half the norm of the first gradient, taken on one device.
    with nnx.use_eager_sharding(False):  # its annotations name axes of no mesh here
        model = Net(nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    grads = jax.grad(lambda p: classification_loss(nnx.merge(graphdef, p, rest), batches[0])[0])(
        params
    )
    expected = 0.5 * float(optax.tree.norm(grads))
    assert history.history["train/grad_norm"][0] == pytest.approx(expected, rel=1e-4)


class Sowing(nnx.Module):
    """Sows its hidden activations (nnx.Intermediate), as Flax's auxiliary-loss examples do."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.net = Net(rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        out = self.net(x)
        self.sow(nnx.Intermediate, "logits", out)
        return out


def activation_penalty_loss(model: nnx.Module, batch: dict) -> tuple[jax.Array, dict]:
    loss, aux = classification_loss(model, batch)
    (sown,) = jax.tree.leaves(nnx.pop(model, nnx.Intermediate))  # the loss reads them
    return loss + 0.01 * (sown**2).mean(), aux


@pytest.mark.parametrize("strategy", [DataParallel(), Hybrid(FSDP(4), TensorParallel(2))])
@pytest.mark.filterwarnings("ignore:Using .Module.sow:DeprecationWarning")
def test_a_model_that_sows_intermediates_trains(strategy):
    batches = make_batches(3)
    trainer = Trainer(Sowing, optax.adam(1e-2), strategy=strategy, loss_fn=activation_penalty_loss)
    trainer.fit(batches, max_steps=3)
    params, _ = train_reference(Sowing, optax.adam(1e-2), batches, activation_penalty_loss)
    assert_params_match(trainer, params)


@pytest.mark.filterwarnings("ignore:Using .Module.sow:DeprecationWarning")
def test_intermediates_a_loss_leaves_in_the_module_are_not_carried():
    batches = make_batches(3)
    trainer = Trainer(Sowing, optax.adam(1e-2), loss_fn=classification_loss)  # never pops
    leaves = len(trainer.run.objects().arrays())
    trainer.fit(batches, max_steps=3)
    trainer.evaluate(batches)
    assert len(trainer.run.objects().arrays()) == leaves
    assert not nnx.state(trainer.model, nnx.Intermediate)
    params, _ = train_reference(Sowing, optax.adam(1e-2), batches)
    assert_params_match(trainer, params)
