"""EarlyStopping and TerminateOnNaN stop fit at the step they should, and say which."""

import jax
import numpy as np
import optax
import pytest
from test_callbacks_helpers import make_batches, make_trainer

from nnx_spmd_trainer import Callback
from nnx_spmd_trainer.callbacks import EarlyStopping, MetricsLogger, TerminateOnNaN


# -- EarlyStopping --------------------------------------------------------------------------
def test_early_stopping_stops_a_plateau_after_patience_evaluations():
    stop = EarlyStopping("eval/loss", patience=2)
    trainer = make_trainer([stop], optax.sgd(0.0))  # lr 0: eval/loss is the same every time
    history = trainer.fit(
        make_batches(10), eval_data=make_batches(2, seed=1), max_steps=10, eval_every_n_steps=1
    )
    # Step 1 sets the best; steps 2 and 3 do not improve it; patience 2 stops at step 3.
    assert trainer.step == 3 and stop.stopped_step == 3
    assert history.steps["eval/loss"] == [1, 2, 3]
    assert stop.best == pytest.approx(history.history["eval/loss"][0])
    assert stop.best_step == 1 and stop.wait == 2


def test_early_stopping_lets_an_improving_run_finish_and_min_delta_raises_the_bar():
    # Gradient descent on the very batch evaluated: a convex loss that falls every step.
    evals = make_batches(1)
    improving = EarlyStopping("eval/loss", patience=1)
    trainer = make_trainer([improving], optax.sgd(0.5))
    history = trainer.fit(evals * 6, eval_data=evals, max_steps=6, eval_every_n_steps=1)
    losses = history.history["eval/loss"]
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False))  # it improves
    assert trainer.step == 6 and improving.stopped_step is None

    # The same run, but no improvement smaller than 10 counts: stops after 1 + patience evals.
    strict = EarlyStopping("eval/loss", patience=1, min_delta=10.0)
    trainer = make_trainer([strict], optax.sgd(0.5))
    trainer.fit(evals * 6, eval_data=evals, max_steps=6, eval_every_n_steps=1)
    assert trainer.step == 2 and strict.stopped_step == 2


def test_early_stopping_mode_max_on_train_metrics_from_metrics_logger():
    stop = EarlyStopping("train/accuracy", patience=0, mode="max")
    trainer = make_trainer([MetricsLogger(2), stop], optax.sgd(0.0))
    # The same two batches again and again: the accuracy over each window is constant.
    batches = make_batches(2) * 5
    trainer.fit(batches, max_steps=10)
    assert trainer.step == 4 and stop.stopped_step == 4


def test_early_stopping_ignores_evaluations_outside_fit():
    stop = EarlyStopping("eval/loss", patience=0)
    trainer = make_trainer([stop], optax.sgd(0.0))
    evals = make_batches(2, seed=1)
    trainer.evaluate(evals)
    trainer.evaluate(evals)
    assert stop.best is None and not trainer.stop_requested


# -- TerminateOnNaN ----------------------------------------------------------------------------
class CheckpointProbe(Callback):
    """Stands in for a checkpoint callback keeping TerminateOnNaN's contract: no save once
    ``nonfinite_step`` is set, nor of a step whose own loss is not finite."""

    def __init__(self) -> None:
        self.saved: dict[int, np.ndarray] = {}

    def on_train_batch_end(self, step, logs):
        if self.trainer.progress.nonfinite_step is None and np.isfinite(
            self.trainer.last_step.loss_value()
        ):
            self.saved[step] = np.asarray(self.trainer.model.l.kernel[...])


def test_terminate_on_nan_stops_at_the_first_nan_step_and_no_checkpoint_sees_it():
    guard, checkpoint = TerminateOnNaN(), CheckpointProbe()
    trainer = make_trainer([checkpoint, guard])
    in_memory = r"went through step 3's update and are not finite.*skip_nonfinite_updates=True"
    with pytest.warns(RuntimeWarning, match=f"at step 3.*{in_memory}"):
        trainer.fit(make_batches(8, nan_at=2), max_steps=8)  # batch 2 is step 3
    # checked without stalling: step 3's loss is read once 2 newer steps are in flight
    assert guard.stopped_step == 3 and trainer.step == 3 + trainer.placement.max_steps_in_flight
    assert trainer.progress.nonfinite_step == 3
    assert not np.isfinite(np.asarray(trainer.model.l.kernel[...])).all()  # the state did diverge
    assert sorted(checkpoint.saved) == [1, 2]
    assert all(np.isfinite(k).all() for k in checkpoint.saved.values())


def test_terminate_on_nan_checking_every_4_steps_still_names_the_exact_step():
    guard = TerminateOnNaN(check_every_n_steps=4)
    trainer = make_trainer([guard])
    with pytest.warns(RuntimeWarning, match="at step 2"):
        trainer.fit(make_batches(8, nan_at=1), max_steps=8)
    assert guard.stopped_step == 2 and trainer.progress.nonfinite_step == 2
    assert trainer.step == 4  # noticed at the first check, step 4


def test_terminate_on_nan_with_huge_learning_rate_diverges_and_stops():
    guard = TerminateOnNaN()
    trainer = make_trainer([guard], optax.sgd(1e38))
    with pytest.warns(RuntimeWarning, match="TerminateOnNaN"):
        trainer.fit(make_batches(10), max_steps=10)
    assert guard.stopped_step is not None and guard.stopped_step < 10
    assert trainer.step <= guard.stopped_step + trainer.placement.max_steps_in_flight


def test_terminate_on_nan_a_new_fit_after_restoring_good_state_starts_clean():
    guard = TerminateOnNaN()
    trainer = make_trainer([guard])
    good = jax.device_get(trainer.state)  # a host copy, as a checkpoint would hold
    with pytest.warns(RuntimeWarning):
        trainer.fit(make_batches(4, nan_at=0), max_steps=4)
    assert guard.stopped_step == 1 and trainer.progress.nonfinite_step == 1

    trainer.state = good
    trainer.fit(make_batches(4), max_steps=5)
    assert guard.stopped_step is None and trainer.progress.nonfinite_step is None
    assert trainer.step == 5
    assert np.isfinite(np.asarray(trainer.model.l.kernel[...])).all()
