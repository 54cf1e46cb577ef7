"""Mistakes a researcher makes get a message naming the culprit, and the state survives."""

import numpy as np
import optax
import pytest
from toy_models import Net, classification_loss, make_batches

from nnx_spmd_trainer import BatchMismatch, Trainer


def trainer_with(loss_fn) -> Trainer:
    return Trainer(lambda r: Net(r), optax.sgd(0.1), loss_fn=loss_fn)


@pytest.mark.parametrize(
    "loss_fn, message",
    [
        (lambda m, b: (classification_loss(m, b)[0] * np.ones(16), {}),
         r"must return a scalar loss; it has shape \(16,\).*\.mean\(\)"),
        (lambda m, b: classification_loss(m, b)[0], r"must return \(loss, aux\).*returned"),
        (lambda m, b: (classification_loss(m, b)[0], [1]), r"aux a dict of arrays; aux is \[1\]"),
    ],
    ids=["not-scalar", "no-aux", "aux-not-dict"],
)  # fmt: skip
def test_a_wrong_loss_return_is_named_before_any_step(loss_fn, message):
    trainer = trainer_with(loss_fn)
    with pytest.raises(TypeError, match=message):
        trainer.fit(make_batches(2), max_steps=2)
    assert trainer.step == 0


def test_a_batch_missing_a_key_midway_names_the_step_and_the_key_and_fit_goes_on():
    batches = make_batches(4)
    broken = [*batches[:2], {"x": batches[2]["x"]}]  # no labels at step 3
    trainer = trainer_with(classification_loss)
    with pytest.raises(BatchMismatch, match=r"^step 3: .*\['y'\] was int32\[16\], is missing"):
        trainer.fit(broken, max_steps=4)
    assert trainer.step == 2
    trainer.fit(batches[2:], max_steps=4)
    assert trainer.step == 4


def test_max_steps_is_global_and_a_fit_that_trains_nothing_says_so():
    trainer = trainer_with(classification_loss)
    trainer.fit(make_batches(3), max_steps=3)
    with pytest.warns(UserWarning, match=r"already at step 3.*max_steps=3 \+ n"):
        trainer.fit(make_batches(3), max_steps=3)
    assert trainer.step == 3


def test_a_one_shot_iterator_with_several_epochs_says_what_ran():
    trainer = trainer_with(classification_loss)
    with pytest.warns(UserWarning, match=r"exhausted at step 2, in epoch 1 of epochs=3.*only 1"):
        trainer.fit(iter(make_batches(2)), epochs=3)
    assert trainer.step == 2
