"""Any optax transformation trains, masks and partitions included; wrt= freezes the rest."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from toy_models import (
    Net,
    assert_params_match,
    classification_loss,
    flat_params,
    make_batches,
    train_reference,
)

from nnx_spmd_trainer import FSDP, Hybrid, TensorParallel, Trainer
from nnx_spmd_trainer.callbacks import OrbaxCheckpoint

FSDP_TP = Hybrid(FSDP(4, min_size=64), TensorParallel(2))


def by_layer(params):
    """ "slow" for l3, "fast" for the rest, from each leaf's path."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "slow" if "l3" in jax.tree_util.keystr(path) else "fast", params
    )


@pytest.mark.parametrize(
    "make_tx",
    [
        lambda: optax.multi_transform(
            {"fast": optax.adam(1e-2), "slow": optax.adam(1e-3)}, by_layer
        ),
        lambda: optax.partition({"fast": optax.adam(1e-2), "slow": optax.sgd(0.1)}, by_layer),
        lambda: optax.masked(
            optax.adamw(1e-2, weight_decay=0.1), lambda p: jax.tree.map(lambda x: x.ndim == 2, p)
        ),
    ],
    ids=["multi_transform", "partition", "masked"],
)
def test_composite_optax_transformations_equal_plain_optax_on_one_device(make_tx):
    batches = make_batches(3)
    trainer = Trainer(lambda r: Net(r), make_tx(), strategy=FSDP_TP, loss_fn=classification_loss)
    trainer.fit(batches, max_steps=3)
    reference, _ = train_reference(lambda r: Net(r), make_tx(), batches)
    assert_params_match(trainer, reference)


def test_wrt_trains_only_what_it_names_and_the_rest_is_bit_identical():
    batches = make_batches(3)
    trainable = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("l1")))
    trainer = Trainer(
        lambda r: Net(r), optax.adamw(1e-2, weight_decay=0.1), strategy=FSDP_TP,
        loss_fn=classification_loss, wrt=trainable,
    )  # fmt: skip
    before = flat_params(nnx.state(trainer.model, nnx.Param))
    trainer.fit(batches, max_steps=3)
    after = flat_params(nnx.state(trainer.model, nnx.Param))
    for key in ("l1/kernel", "l1/bias"):
        np.testing.assert_array_equal(after[key], before[key], err_msg=key)  # bit-identical
    frozen_l1 = optax.multi_transform(
        {"train": optax.adamw(1e-2, weight_decay=0.1), "frozen": optax.set_to_zero()},
        lambda p: jax.tree_util.tree_map_with_path(
            lambda path, _: "frozen" if "l1" in jax.tree_util.keystr(path) else "train", p
        ),
    )
    reference, _ = train_reference(lambda r: Net(r), frozen_l1, batches)
    assert_params_match(trainer, reference)


def test_a_masked_optimizer_state_checkpoints_and_restores(tmp_path):
    tx = lambda: optax.multi_transform(  # noqa: E731
        {"fast": optax.adam(1e-2), "slow": optax.set_to_zero()}, by_layer
    )
    first = Trainer(lambda r: Net(r), tx(), strategy=FSDP_TP, loss_fn=classification_loss,
                    callbacks=[OrbaxCheckpoint(tmp_path)])  # fmt: skip
    first.fit(make_batches(2), max_steps=2)
    again = Trainer(lambda r: Net(r), tx(), strategy=FSDP_TP, loss_fn=classification_loss,
                    callbacks=[OrbaxCheckpoint(tmp_path)])  # fmt: skip
    again.fit(make_batches(2), max_steps=2)
    assert again.step == 2
    for key, value in flat_params(nnx.state(first.model, nnx.Param)).items():
        np.testing.assert_array_equal(flat_params(nnx.state(again.model, nnx.Param))[key], value)


def test_an_optimizer_that_is_not_a_transformation_is_named():
    with pytest.raises(TypeError, match=r"GradientTransformation.*call it: optax.adam\(1e-3\)"):
        Trainer(lambda r: Net(r), optax.adam, loss_fn=classification_loss)
