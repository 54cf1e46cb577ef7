"""A resumed run reports what an uninterrupted one does, and the error path hides nothing."""

import numpy as np
import optax
import pytest
from toy_models import Net, classification_loss, make_batches

from nnx_spmd_trainer import FSDP, Callback, Hybrid, TensorParallel, Trainer
from nnx_spmd_trainer.callbacks import OrbaxCheckpoint

FSDP_TP = Hybrid(FSDP(4, min_size=64), TensorParallel(2))


def trainer_for(*callbacks) -> Trainer:
    return Trainer(
        Net,
        optax.adam(1e-2),
        strategy=FSDP_TP,
        loss_fn=classification_loss,
        log_every_n_steps=2,
        callbacks=list(callbacks),
    )


def reported(trainer: Trainer) -> dict[str, list[tuple[int, float]]]:
    """Every logged value but host timings, with its step."""
    history = trainer.history
    return {
        key: list(zip(history.steps[key], history.history[key], strict=True))
        for key in history.history
        if not key.startswith(("perf/", "goodput/"))
    }


@pytest.mark.slow
def test_a_run_resumed_from_a_fit_that_ended_between_log_points_logs_as_if_never_stopped(
    tmp_path,
):
    train, evals = make_batches(10), make_batches(2, seed=1)
    whole = trainer_for()
    whole.fit(train, evals, max_steps=8, eval_every_n_steps=4)

    first = trainer_for(OrbaxCheckpoint(tmp_path))
    first.fit(train, evals, max_steps=5, eval_every_n_steps=4)  # ends at 5: log points are even
    assert 5 in first.history.steps["train/loss"]  # its own final report, which it did log
    resumed = trainer_for(OrbaxCheckpoint(tmp_path))
    resumed.fit(train, evals, max_steps=8, eval_every_n_steps=4)

    # The same points at the same steps, bitwise: the loss at 6 averages steps 5 and 6.
    assert reported(resumed) == reported(whole)


class HeardErrors(Callback):
    def __init__(self) -> None:
        self.errors: list[BaseException] = []

    def on_exception(self, error):
        self.errors.append(error)


def test_a_state_the_trainer_cannot_read_raises_its_own_error_and_callbacks_hear_of_it():
    heard = HeardErrors()
    trainer = Trainer(Net, optax.sgd(0.1), loss_fn=classification_loss, callbacks=[heard])
    # What a restore without targets leaves behind: nested dicts of NumPy arrays.
    trainer.model.l1.kernel.set_value({"value": np.zeros((16, 32), np.float32)})
    with pytest.raises(Exception) as raised:
        trainer.fit(make_batches(2), max_steps=1)
    assert "is_deleted" not in str(raised.value)  # not an error of the error path
    assert heard.errors == [raised.value]
