"""Metrics under gradient accumulation (issue 16): per-example ``aux`` rows come back in
batch order, so the mask of a padded batch counts the real rows; a scalar ``aux`` is
averaged like the loss, with no CLU warning about the mask."""

from __future__ import annotations

import logging
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from clu import metrics as clu_metrics
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from toy_models import Net, assert_params_match, make_batches, train_reference

from nnx_spmd_trainer import DataParallel, Trainer, masked_mean
from nnx_spmd_trainer.planner.step import compute_gradients


def loss_with_aux(model: nnx.Module, batch: dict) -> tuple[jax.Array, dict]:
    """A masked per-example loss; aux: per-example correctness and row index, and the
    batch's accuracy as a scalar."""
    logits = model(batch["x"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    correct = logits.argmax(-1) == batch["y"]
    aux = {"correct": correct, "index": batch["i"], "scalar_accuracy": masked_mean(correct, batch)}
    return masked_mean(losses, batch), aux


Metrics = clu_metrics.Collection.create(
    loss=clu_metrics.Average.from_output("loss"),
    accuracy=clu_metrics.Average.from_output("correct"),
    index=clu_metrics.Average.from_output("index"),
    scalar_accuracy=clu_metrics.Average.from_output("scalar_accuracy"),
)


def odd_batches(sizes: list[int], seed: int = 0) -> list[dict]:
    """Batches of ``sizes`` rows, each row carrying its index in its batch as ``"i"``."""
    rows = make_batches(1, batch_size=sum(sizes), seed=seed)[0]
    starts = np.cumsum([0, *sizes])
    return [
        {
            "x": rows["x"][a:b],
            "y": rows["y"][a:b],
            "i": np.arange(b - a, dtype=np.float32),
        }
        for a, b in zip(starts, starts[1:], strict=False)
    ]


def numpy_correct(params: nnx.State, batch: dict) -> np.ndarray:
    """Per-example correctness of a one-device model holding ``params``, read in NumPy."""
    with nnx.use_eager_sharding(False):
        model = Net(nnx.Rngs(0))
    nnx.update(model, jax.device_get(params))
    logits = np.asarray(jax.device_get(model(jax.device_put(batch["x"], jax.devices()[0]))))
    return logits.argmax(-1) == batch["y"]


def reference_metrics(data: list[dict], tx_fn) -> list[tuple[float, float]]:
    """Per step: accuracy and mean row index over its real rows, with the parameters
    plain optax on one device holds before that step."""
    found = []
    for step, batch in enumerate(data):
        params, _ = train_reference(Net, tx_fn(), data[:step], loss_with_aux)
        found.append((float(numpy_correct(params, batch).mean()), float(batch["i"].mean())))
    return found


@pytest.mark.parametrize("accum", [2, 4])
def test_padded_batches_with_accumulation_count_the_real_rows(accum: int):
    data = odd_batches([13, 11, 19])
    trainer = Trainer(
        Net,
        optax.adam(1e-2),
        strategy=DataParallel(),
        loss_fn=loss_with_aux,
        grad_accum_steps=accum,
        metrics=Metrics,
        log_every_n_steps=1,
    )
    padded = [trainer.padded(b) for b in data]
    assert all(len(b["mask"]) % (8 * accum) == 0 for b in padded)
    assert all(b["mask"].sum() < len(b["mask"]) for b in padded)  # every batch has padding
    logs = trainer.fit(padded, max_steps=len(data)).history
    want = reference_metrics(data, lambda: optax.adam(1e-2))
    params, _ = train_reference(Net, optax.adam(1e-2), data, loss_with_aux)
    assert_params_match(trainer, params)
    # The padding repeats a batch's last row: counting it would raise the mean index.
    np.testing.assert_allclose(logs["train/index"], [i for _, i in want], rtol=1e-6)
    np.testing.assert_allclose(logs["train/accuracy"], [a for a, _ in want], atol=1e-6)
    np.testing.assert_allclose(logs["train/scalar_accuracy"], [a for a, _ in want], atol=1e-6)


def test_accumulated_aux_rows_are_in_batch_order_and_a_scalar_is_weighted_by_real_rows():
    """``compute_gradients`` itself, under jit on 8 devices: per-example aux equals the
    batch's rows in order; a scalar aux is the real-row-weighted mean of the microbatches'."""
    mesh = DataParallel().make_mesh()
    rows, k = 32, 4
    mask = np.ones(rows, np.float32)
    mask[-7:] = 0  # padding: microbatches 1, 2 and 3 hold 2 padding rows each, microbatch 0 one
    batch = {"v": np.arange(rows, dtype=np.float32) * 10, "mask": mask}
    sharding = {key: NamedSharding(mesh, P("data")) for key in batch}
    batch = jax.device_put(batch, sharding)

    class Scale(nnx.Module):
        def __init__(self) -> None:
            self.w = nnx.Param(jnp.ones(()))

    def loss_fn(model: nnx.Module, batch: dict) -> tuple[jax.Array, dict]:
        values = model.w[...] * batch["v"]
        return masked_mean(values, batch), {"row": values, "mean": masked_mean(values, batch)}

    graphdef, state = nnx.split(Scale())

    @jax.jit
    def run(state: nnx.State, batch: dict) -> tuple[jax.Array, dict]:
        model = nnx.merge(graphdef, state)
        loss, aux, _ = compute_gradients(
            model, batch, loss_fn, grad_accum_steps=k, batch_sharding=sharding
        )
        return loss, aux

    loss, aux = run(state, batch)
    values = np.arange(rows) * 10.0
    np.testing.assert_array_equal(np.asarray(aux["row"]), values)  # batch order, not microbatch
    assert aux["row"].sharding.spec == P("data")
    real = values[mask > 0].mean()
    assert float(aux["mean"]) == pytest.approx(real, rel=1e-6)
    assert float(loss) == pytest.approx(real, rel=1e-6)


@pytest.mark.parametrize("accum", [1, 2])
def test_a_scalar_aux_is_averaged_over_examples_without_a_mask_warning(accum: int, caplog):
    """A scalar aux counts like the loss: once per real example, so over unequal batches
    it is the per-example mean; CLU has no reason to warn that it ignores the mask."""
    data = odd_batches([13, 21], seed=1)
    trainer = Trainer(
        Net,
        optax.sgd(0.1),
        strategy=DataParallel(),
        loss_fn=loss_with_aux,
        grad_accum_steps=accum,
        metrics=Metrics,
    )
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        logs = trainer.fit(map(trainer.padded, data), max_steps=2).history
    messages = [str(w.message) for w in caught] + [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "mask" in m.lower()], messages
    correct = np.concatenate(
        [
            numpy_correct(train_reference(Net, optax.sgd(0.1), data[:step], loss_with_aux)[0], b)
            for step, b in enumerate(data)
        ]
    )
    assert logs["train/scalar_accuracy"][-1] == pytest.approx(correct.mean(), abs=1e-6)
    assert logs["train/accuracy"][-1] == pytest.approx(correct.mean(), abs=1e-6)
