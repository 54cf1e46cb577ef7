"""A bad batch midway names its step, the leaf and what changed, and leaves the state as it was.

Each case trains two good steps, then a bad batch at step 3: the error is a
``BatchMismatch`` raised before step 3 runs, the parameters are bitwise those of
a run that stopped at step 2, and ``fit`` with good data goes on exactly as an
uninterrupted run.
"""

from __future__ import annotations

import numpy as np
import optax
import pytest
from flax import nnx
from toy_models import Net, classification_loss, flat_params, make_batches

from nnx_spmd_trainer import BatchMismatch, ShardingError, Trainer

GOOD = make_batches(4)


def make_trainer(**kwargs) -> Trainer:
    # Adam: the optimizer's moments and count must survive the error too.
    return Trainer(Net, optax.adam(1e-2), loss_fn=classification_loss, **kwargs)


def params(trainer: Trainer) -> dict[str, np.ndarray]:
    return flat_params(nnx.state(trainer.model, nnx.Param))


def assert_bitwise(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


@pytest.fixture(scope="module")
def reference() -> dict[int, dict[str, np.ndarray]]:
    """The parameters of an uninterrupted run after step 2 and after step 4."""
    trainer = make_trainer()
    trainer.fit(GOOD, max_steps=2)
    after_2 = params(trainer)
    trainer.fit(GOOD[2:], max_steps=4)
    return {2: after_2, 4: params(trainer)}


def without_y(batch: dict) -> dict:
    return {"x": batch["x"]}


def wider(batch: dict) -> dict:
    return {**batch, "x": np.concatenate([batch["x"], batch["x"][:, :1]], axis=1)}


def float_labels(batch: dict) -> dict:
    return {**batch, "y": batch["y"].astype(np.float32)}


@pytest.mark.parametrize(
    "spoil, change, cause",
    [
        (without_y, "['y'] was int32[16], is missing", "MissingBatchKey: "),
        (wider, "['x'] was float32[16,16], is float32[16,17]", "TypeError: dot_general"),
        (float_labels, "['y'] was int32[16], is float32[16]", "TypeError"),
    ],
    ids=["missing-key", "17-features", "float-labels"],
)
def test_a_bad_batch_at_step_3_names_step_leaf_and_change_and_keeps_step_2s_state(
    spoil, change, cause, reference
):
    trainer = make_trainer()
    with pytest.raises(BatchMismatch) as caught:
        trainer.fit([*GOOD[:2], spoil(GOOD[2]), GOOD[3]], max_steps=4)
    message = str(caught.value)
    assert message.startswith("step 3: the batch differs from the batches before it: ")
    assert change in message and f"(the step's error: {cause}" in message
    assert caught.value.where == "step 3" and len(caught.value.changes) == 1
    assert isinstance(caught.value.__cause__, KeyError | TypeError)  # chained from the step's
    assert trainer.step == 2
    assert_bitwise(params(trainer), reference[2])  # step 3 never ran
    trainer.fit(GOOD[2:], max_steps=4)
    assert_bitwise(params(trainer), reference[4])


def test_a_new_batch_size_the_step_takes_just_traces_again():
    half = {key: value[:8] for key, value in GOOD[2].items()}
    trainer = make_trainer()
    trainer.fit([*GOOD[:2], half, GOOD[3]], max_steps=4)
    assert trainer.step == 4


def test_a_batch_that_cannot_be_placed_read_ahead_names_its_step():
    trainer = make_trainer(prefetch=2)
    five_rows = {key: value[:5] for key, value in GOOD[2].items()}
    with pytest.raises(BatchMismatch, match=r"^step 3: .*\['x'\] was float32\[16,16\], is "
                       r"float32\[5,16\].*ShardingError: .*5 rows") as caught:  # fmt: skip
        trainer.fit([*GOOD[:2], five_rows, GOOD[3]], max_steps=4)
    assert isinstance(caught.value.__cause__, ShardingError)
    assert trainer.step == 2


def test_a_bad_evaluation_batch_names_its_index_and_the_change():
    trainer = make_trainer()
    trainer.fit(GOOD[:1], max_steps=1)
    with pytest.raises(BatchMismatch, match=r"^evaluation batch 2 \(after step 1\): .*\['y'\] "
                       r"was int32\[16\], is missing") as caught:  # fmt: skip
        trainer.evaluate([GOOD[1], without_y(GOOD[2])])
    assert isinstance(caught.value.__cause__, KeyError)
    assert trainer.evaluate(GOOD[1:3])["loss"] > 0  # evaluation still works
