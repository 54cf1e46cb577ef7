"""Losses and metrics are averaged over examples; batches of any size work (padded, masked)."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from clu import metrics as clu_metrics
from flax import nnx
from toy_models import Net, RecordLosses, assert_params_match, make_batches, train_reference

from nnx_spmd_trainer import (
    FSDP,
    DataParallel,
    Hybrid,
    ShardingError,
    TensorParallel,
    Trainer,
    masked_mean,
)
from nnx_spmd_trainer.data import pad_batch


def per_example_loss(model: nnx.Module, batch: dict) -> tuple[jax.Array, dict]:
    logits = model(batch["x"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return masked_mean(losses, batch), {"accuracy": logits.argmax(-1) == batch["y"]}


Metrics = clu_metrics.Collection.create(
    loss=clu_metrics.Average.from_output("loss"),
    accuracy=clu_metrics.Average.from_output("accuracy"),
)


def numpy_eval(model: nnx.Module, batches: list[dict]) -> tuple[float, float]:
    """Per-example mean loss and accuracy over all rows, from one unsharded forward pass."""
    x = np.concatenate([b["x"] for b in batches])
    y = np.concatenate([b["y"] for b in batches])
    model.eval()
    logits = np.asarray(jax.device_get(model(jax.device_put(x, jax.devices()[0]))), np.float64)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    losses = -log_probs[np.arange(len(y)), y]
    return float(losses.mean()), float((logits.argmax(-1) == y).mean())


def unsharded_copy(trainer: Trainer) -> nnx.Module:
    with nnx.use_eager_sharding(False):
        model = Net(nnx.Rngs(0))
    nnx.update(model, jax.device_get(nnx.state(trainer.model)))
    return model


def cut(batches: list[dict], sizes: list[int]) -> list[dict]:
    """The rows of ``batches`` recut into batches of ``sizes``."""
    rows = {k: np.concatenate([b[k] for b in batches]) for k in ("x", "y")}
    starts = np.cumsum([0, *sizes])
    return [{k: v[a:b] for k, v in rows.items()} for a, b in zip(starts, starts[1:], strict=False)]


@pytest.fixture(scope="module")
def trained() -> Trainer:
    trainer = Trainer(Net, optax.adam(1e-2), loss_fn=per_example_loss, metrics=Metrics)
    trainer.fit(make_batches(3), max_steps=3)
    return trainer


def test_eval_over_unequal_batches_is_the_per_example_mean(trained: Trainer):
    data = cut(make_batches(3, seed=1), [16, 16, 8])
    loss, accuracy = numpy_eval(unsharded_copy(trained), data)
    logs = trained.evaluate(data)
    # A mean of batch means would weight the 8 rows of the last batch double.
    assert logs["loss"] == pytest.approx(loss, rel=1e-5)
    assert logs["accuracy"] == pytest.approx(accuracy, abs=1e-6)


@pytest.mark.parametrize("sizes", [[16, 16, 5], [37]], ids=["last-batch-5", "one-batch-37"])
def test_an_eval_set_of_37_examples_on_8_devices(trained: Trainer, sizes: list[int]):
    data = cut(make_batches(3, seed=2), sizes)
    loss, accuracy = numpy_eval(unsharded_copy(trained), data)
    logs = trained.evaluate(data)
    assert logs["loss"] == pytest.approx(loss, rel=1e-5)
    assert logs["accuracy"] == pytest.approx(accuracy, abs=1e-6)


def test_train_loss_over_unequal_batches_is_weighted_by_examples():
    data = cut(make_batches(2), [16, 8])
    trainer = Trainer(Net, optax.sgd(0.1), loss_fn=per_example_loss)
    history = trainer.fit(data, max_steps=2)
    _, losses = train_reference(Net, optax.sgd(0.1), data, per_example_loss)
    expected = (16 * losses[0] + 8 * losses[1]) / 24
    assert history.history["train/loss"][-1] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize(
    "strategy, accum",
    [(DataParallel(), 1), (DataParallel(), 2), (Hybrid(FSDP(4), TensorParallel(2)), 2)],
    ids=["dp", "dp-accum2", "fsdp-x-tp-accum2"],
)
def test_padded_training_equals_the_unpadded_batches(strategy, accum: int):
    """Batches of 13 and 21 rows, padded for the mesh and the microbatches, train exactly
    as plain optax on the unpadded rows: each microbatch counts by its real examples."""
    data = cut(make_batches(3), [13, 21])
    recorder = RecordLosses()
    trainer = Trainer(
        Net,
        optax.adam(1e-2),
        strategy=strategy,
        loss_fn=per_example_loss,
        grad_accum_steps=accum,
        callbacks=[recorder],
    )
    history = trainer.fit(map(trainer.padded, data), max_steps=2)
    params, losses = train_reference(Net, optax.adam(1e-2), data, per_example_loss)
    assert_params_match(trainer, params)
    np.testing.assert_allclose(recorder.losses, losses, rtol=1e-5)
    expected = (13 * losses[0] + 21 * losses[1]) / 34
    assert history.history["train/loss"][-1] == pytest.approx(expected, rel=1e-5)


def test_pad_batch_repeats_the_last_row_and_masks_it():
    batch = {"x": np.arange(6, dtype=np.float32).reshape(3, 2), "y": np.array([1, 2, 3])}
    padded = pad_batch(batch, 4)
    np.testing.assert_array_equal(padded["x"][3], batch["x"][2])
    np.testing.assert_array_equal(padded["mask"], [1, 1, 1, 0])
    again = pad_batch(pad_batch(batch, 4), 8)  # an existing mask is kept and extended
    np.testing.assert_array_equal(again["mask"], [1, 1, 1, 0, 0, 0, 0, 0])
    with pytest.raises(TypeError, match="Only a dict batch can be padded"):
        pad_batch((batch["x"], batch["y"]), 4)


def test_a_training_batch_that_does_not_split_names_the_padding_helper():
    trainer = Trainer(Net, optax.sgd(0.1), loss_fn=per_example_loss)
    with pytest.raises(ShardingError, match="Trainer.padded"):
        trainer.fit(cut(make_batches(1), [13]), max_steps=1)
