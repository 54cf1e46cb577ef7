"""Trainer behaviour: one trace per fit, gradient accumulation, evaluation, errors, no hang."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from toy_models import (
    Net,
    RecordLosses,
    assert_params_match,
    classification_loss,
    flat_params,
    make_batches,
    train_reference,
)

from nnx_spmd_trainer import FSDP, DataParallel, Hybrid, ShardingError, TensorParallel, Trainer

FSDP_TP = Hybrid(FSDP(4, min_size=64), TensorParallel(2))


class CountingTrainer(Trainer):
    """Research-code style: the loss is a method of a Trainer subclass."""

    traces = 0
    eval_traces = 0

    def loss_fn(self, model, batch):
        type(self).traces += 1  # runs only while jax traces the step
        return classification_loss(model, batch)

    def eval_fn(self, model, batch):
        type(self).eval_traces += 1
        return classification_loss(model, batch)


def test_train_step_traced_once_over_a_multi_step_fit():
    CountingTrainer.traces = CountingTrainer.eval_traces = 0
    trainer = CountingTrainer(lambda r: Net(r), optax.adam(1e-2), strategy=FSDP_TP)
    batches = make_batches(4)
    history = trainer.fit(batches, eval_data=batches[:2], epochs=3, eval_every_n_steps=5)
    assert trainer.step == 12
    assert CountingTrainer.traces == 1
    assert CountingTrainer.eval_traces == 1
    assert history.steps["eval/loss"] == [5, 10, 12]
    assert history.steps["train/loss"] == [4, 8, 12]  # flushed at each epoch end


def test_subclassed_loss_trains_like_reference():
    batches = make_batches(3)
    trainer = CountingTrainer(lambda r: Net(r), optax.adam(1e-2), strategy=FSDP_TP)
    trainer.fit(batches, max_steps=3)
    ref, _ = train_reference(lambda r: Net(r), optax.adam(1e-2), batches)
    assert_params_match(trainer, ref)


@pytest.mark.parametrize("strategy", [DataParallel(), FSDP_TP], ids=["dp8", "fsdp4xtp2"])
def test_gradient_accumulation_equals_one_large_batch(strategy):
    k = 4
    big = make_batches(3, batch_size=8 * k)
    recorder = RecordLosses()
    trainer = Trainer(
        lambda r: Net(r),
        optax.adam(1e-2),
        strategy=strategy,
        loss_fn=classification_loss,
        grad_accum_steps=k,
        callbacks=[recorder],
    )
    trainer.fit(big, max_steps=3)
    ref, ref_losses = train_reference(lambda r: Net(r), optax.adam(1e-2), big)
    np.testing.assert_allclose(recorder.losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert_params_match(trainer, ref)


def test_evaluate_matches_numpy_loss_of_current_parameters():
    batches = make_batches(2, seed=1)
    trainer = Trainer(
        lambda r: Net(r), optax.adam(1e-2), strategy=FSDP_TP, loss_fn=classification_loss
    )
    trainer.fit(make_batches(2), max_steps=2)
    results = trainer.evaluate(batches)
    # Independent: the same parameters gathered to the host and run on one device.
    graphdef, state = nnx.split(trainer.model)
    host_model = nnx.merge(graphdef, jax.device_get(state))
    host_model.eval()
    want = np.mean(
        [
            float(
                optax.softmax_cross_entropy_with_integer_labels(host_model(b["x"]), b["y"]).mean()
            )
            for b in batches
        ]
    )
    assert results.keys() == {"loss"}
    np.testing.assert_allclose(results["loss"], want, rtol=1e-5)


@pytest.mark.slow
def test_several_hundred_steps_on_eight_devices_do_not_hang():
    batches = make_batches(10)
    trainer = Trainer(
        lambda r: Net(r),
        optax.sgd(1e-2),
        strategy=FSDP_TP,
        loss_fn=classification_loss,
        max_steps_in_flight=2,
    )
    history = trainer.fit(batches, epochs=40)
    assert trainer.step == 400
    assert np.isfinite(history.history["train/loss"]).all()


def test_batch_not_divisible_by_data_parallel_size():
    trainer = Trainer(
        lambda r: Net(r),
        optax.sgd(0.1),
        loss_fn=classification_loss,
        strategy=Hybrid(DataParallel(4), TensorParallel(2)),
    )
    with pytest.raises(
        ShardingError, match=r"batch leaf \['x'\].*global batch of 6 rows.*\('data',\).*by 4"
    ):
        trainer.fit(make_batches(1, batch_size=6), max_steps=1)
    scalar = {**make_batches(1)[0], "weight": np.float32(1.0)}
    with pytest.raises(ShardingError, match=r"batch leaf \['weight'\].*is a scalar"):
        trainer.fit([scalar], max_steps=1)


def test_batch_not_divisible_by_microbatches():
    trainer = Trainer(
        lambda r: Net(r), optax.sgd(0.1), loss_fn=classification_loss, grad_accum_steps=3
    )
    with pytest.raises(ShardingError, match=r"8 parts x 3 microbatches.*divisible by 24"):
        trainer.fit(make_batches(1, batch_size=16), max_steps=1)


def test_annotated_dimension_the_axis_does_not_divide():
    with pytest.raises(ShardingError) as err:
        Trainer(
            lambda r: Net(r, hidden=12),
            optax.sgd(0.1),
            loss_fn=classification_loss,
            strategy=TensorParallel(8),
        )
    assert "model/l1/bias" in str(err.value) and "(12,)" in str(err.value)
    assert "'model': 8" in str(err.value)


def test_unknown_logical_axis_names_the_parameter():
    class Odd(nnx.Module):
        def __init__(self, rngs):
            init = nnx.with_metadata(nnx.initializers.lecun_normal(), out_sharding=("embd", None))
            self.proj = nnx.Linear(8, 8, kernel_init=init, rngs=rngs)

    with pytest.raises(ShardingError, match=r"model/proj/kernel.*unknown axis name 'embd'"):
        Trainer(lambda r: Odd(r), optax.sgd(0.1), loss_fn=classification_loss)


def test_missing_loss_and_missing_stop_condition():
    with pytest.raises(TypeError, match="pass loss_fn="):
        Trainer(lambda r: Net(r), optax.sgd(0.1))
    trainer = Trainer(lambda r: Net(r), optax.sgd(0.1), loss_fn=classification_loss)
    with pytest.raises(ValueError, match="max_steps=... or epochs="):
        trainer.fit(make_batches(1))
    with pytest.raises(ValueError, match="yielded no batches"):
        trainer.fit([], max_steps=1)


def test_factory_must_return_a_module():
    with pytest.raises(TypeError, match="not an nnx.Module"):
        Trainer(lambda r: {"w": 1}, optax.sgd(0.1), loss_fn=classification_loss)
    # A factory of no argument (or of two) is named at once, with the fix.
    with pytest.raises(TypeError, match=r"called with one argument, an nnx.Rngs.*lambda rngs"):
        Trainer(lambda: Net(nnx.Rngs(0)), optax.sgd(0.1), loss_fn=classification_loss)
    with pytest.raises(TypeError, match="cannot take it"):
        Trainer(lambda r, width: Net(r), optax.sgd(0.1), loss_fn=classification_loss)
    assert Trainer(Net, optax.sgd(0.1), loss_fn=classification_loss).step == 0  # a class works


def test_a_loss_without_aux_is_named_by_its_type_with_the_fix():
    def loss_only(model, batch):
        return classification_loss(model, batch)[0]

    trainer = Trainer(lambda r: Net(r), optax.sgd(0.1), loss_fn=loss_only)
    with pytest.raises(TypeError, match=r"returned an array float32\[\] \(return loss, \{\}\)"):
        trainer.fit(make_batches(1), max_steps=1)


def test_one_shot_iterator_stops_with_a_warning():
    trainer = Trainer(lambda r: Net(r), optax.sgd(0.1), loss_fn=classification_loss)
    with pytest.warns(UserWarning, match="exhausted at step 3"):
        trainer.fit(iter(make_batches(3)), max_steps=10)
    assert trainer.step == 3


def test_saved_state_restores_after_more_training():
    trainer = Trainer(lambda r: Net(r), optax.adam(1e-2), strategy=FSDP_TP,
                      loss_fn=classification_loss)  # fmt: skip
    trainer.fit(make_batches(2), max_steps=2)
    saved = jax.tree.map(jnp.copy, trainer.state)  # an on-device snapshot
    before = flat_params(nnx.state(trainer.model, nnx.Param))
    trainer.fit(make_batches(3, seed=5), max_steps=5)
    moved = flat_params(nnx.state(trainer.model, nnx.Param))
    assert not np.allclose(moved["l3/kernel"], before["l3/kernel"])
    trainer.state = saved
    restored = flat_params(nnx.state(trainer.model, nnx.Param))
    for key in before:
        np.testing.assert_array_equal(restored[key], before[key], err_msg=key)
    assert trainer.model.l1.kernel.get_value().sharding.spec == P("fsdp", "model")
    trainer.fit(make_batches(1), max_steps=6)  # and training goes on from it
    assert trainer.step == 6


def test_reading_state_does_not_alias_the_live_model():
    trainer = Trainer(lambda r: Net(r), optax.sgd(0.1), loss_fn=classification_loss)
    snapshot = trainer.state  # views are current here: a fresh split
    kernel = snapshot["model"]["l3"]["kernel"]
    trainer.model.l3.kernel.set_value(kernel.get_value() + 1.0)  # edit the live model in place
    assert not np.allclose(np.asarray(trainer.model.l3.kernel.get_value()),
                           np.asarray(kernel.get_value()))  # fmt: skip
