"""Trainer.predict: the outputs of the model called on one device, padding trimmed."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from toy_models import Net, classification_loss, make_batches

from nnx_spmd_trainer import FSDP, Hybrid, TensorParallel, Trainer


class DroppedNet(Net):
    """Net with dropout: predict must run the model in eval mode."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        super().__init__(rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return super().__call__(self.drop(x))


@pytest.fixture(scope="module")
def trained() -> Trainer:
    trainer = Trainer(
        DroppedNet,
        optax.adam(1e-2),
        strategy=Hybrid(FSDP(4, min_size=64), TensorParallel(2)),
        loss_fn=classification_loss,
    )
    trainer.fit(make_batches(2), max_steps=2)
    return trainer


def one_device_copy(trainer: Trainer) -> nnx.Module:
    """The trained model's parameters in a fresh model on one device, in eval mode."""
    with nnx.use_eager_sharding(False):  # annotated axes need no mesh on one device
        model = DroppedNet(nnx.Rngs(1))
    nnx.update(model, jax.device_get(nnx.state(trainer.model, nnx.Param)))
    model.eval()
    return model


def test_predict_equals_the_model_called_on_one_device_with_padding_trimmed(trained):
    reference = one_device_copy(trained)
    inputs = [b["x"] for b in make_batches(2, seed=5)] + [make_batches(1, batch_size=13)[0]["x"]]
    got = trained.predict([{"x": x} for x in inputs], to_numpy=True)
    assert [g.shape for g in got] == [(16, 8), (16, 8), (13, 8)]  # 13 rows padded to 16, trimmed
    for out, x in zip(got, inputs, strict=True):
        assert isinstance(out, np.ndarray)
        np.testing.assert_allclose(out, np.asarray(reference(x)), rtol=1e-5, atol=1e-6)
    again = trained.predict([{"x": inputs[0]}])  # dropout off: the same outputs again
    assert isinstance(again[0], jax.Array)
    np.testing.assert_array_equal(np.asarray(again[0]), got[0])


def test_predict_fn_is_overridable_and_the_default_names_its_convention(trained):
    class Probabilities(Trainer):
        def predict_fn(self, model, batch):
            return {"probs": jax.nn.softmax(model(batch["features"]))}

    reference = one_device_copy(trained)
    trainer = Probabilities(trained.plan, loss_fn=classification_loss)
    trainer.state = trained.state
    x = make_batches(1, seed=7)[0]["x"]
    (out,) = trainer.predict([{"features": x}], to_numpy=True)
    np.testing.assert_allclose(out["probs"], jax.nn.softmax(reference(x)), rtol=1e-5, atol=1e-6)

    with pytest.raises(TypeError, match=r"model\(batch\['x'\]\).*\['features'\].*predict_fn"):
        trained.predict([{"features": x}])
