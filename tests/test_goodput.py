"""Where the wall time of fit went: the parts add up, input waits and checkpoints show."""

import time

import jax
import jax.numpy as jnp
import optax
import pytest
from toy_models import Net, classification_loss, make_batches

from nnx_spmd_trainer import Callback, Trainer
from nnx_spmd_trainer.callbacks import OrbaxCheckpoint
from nnx_spmd_trainer.engine.metric_log import GOODPUT


def trainer_for(**kwargs) -> Trainer:
    return Trainer(Net, optax.sgd(0.1), loss_fn=classification_loss, **kwargs)


def parts(trainer: Trainer) -> dict[str, float]:
    goodput = trainer.run.timings.goodput()
    return {part: goodput[f"goodput/{part}_s"] for part in GOODPUT} | {
        "wall": goodput["goodput/wall_s"]
    }


def test_the_parts_add_up_to_the_wall_time_of_fit_and_reach_the_history():
    trainer = trainer_for(log_every_n_steps=4)
    start = time.perf_counter()
    trainer.fit(make_batches(8), make_batches(2, seed=1), max_steps=8, eval_every_n_steps=4)
    wall = time.perf_counter() - start
    seen = parts(trainer)
    assert sum(seen[p] for p in GOODPUT) == pytest.approx(seen["wall"], rel=1e-9)
    assert abs(seen["wall"] - wall) <= 0.05 * wall
    assert seen["compile"] > 0 and seen["step"] > 0 and seen["eval"] > 0
    assert trainer.history.steps["goodput/step_s"] == [4, 8]


class Sleepy:
    """A dataset whose every batch takes ``seconds`` (50 ms) to read."""

    def __init__(self, batches, seconds: float = 0.05) -> None:
        self.batches, self.seconds = batches, seconds

    def __iter__(self):
        for batch in self.batches:
            time.sleep(self.seconds)
            yield batch


def test_a_slow_dataset_shows_as_input_wait_not_as_step_time():
    trainer = trainer_for()
    trainer.fit(make_batches(2), max_steps=2)  # compiled here, not in the timed fit
    trainer.fit(Sleepy(make_batches(10)), max_steps=12)
    seen = parts(trainer)
    assert seen["data_wait"] >= 0.8 * 10 * 0.05
    assert seen["step"] < seen["data_wait"] / 2


def heavy_loss(model, batch):
    """The toy loss, after ~0.1 s of matmuls on the device (10 of them took 17 ms on a CI
    core): a step several times slower than its 20 ms input."""
    x = jnp.full((512, 512), 1e-3)
    x = jax.lax.fori_loop(0, 60, lambda _, x: jnp.tanh(x @ x), x)
    loss, metrics = classification_loss(model, batch)
    return loss + 0.0 * x.sum(), metrics


def test_batches_taken_while_a_step_computes_are_step_time_not_input_wait():
    # Inline taking (prefetch=0): each 20 ms read runs while the previous step computes
    # on the device, so the devices never wait for it.
    trainer = Trainer(
        Net,
        optax.sgd(0.1),
        loss_fn=heavy_loss,
        devices=jax.devices()[:1],
        prefetch=0,
        log_every_n_steps=100,  # no log point syncs the devices in between
    )
    trainer.fit(make_batches(2), max_steps=2)  # compiled here, not in the timed fit
    trainer.fit(Sleepy(make_batches(8), seconds=0.02), max_steps=10)
    seen = parts(trainer)  # of the second fit
    assert seen["data_wait"] < 0.5 * 8 * 0.02  # at most the first read and a stray one
    assert seen["step"] >= 8 * 0.02


class Sleeper(Callback):
    def on_train_batch_end(self, step, logs):
        time.sleep(0.02)


def test_checkpoint_saves_and_other_callbacks_show_as_their_own_parts(tmp_path):
    saved_seconds = []

    class TimedCheckpoint(OrbaxCheckpoint):  # the blocked time of each save, measured here
        def save(self, step, **kwargs):
            start = time.perf_counter()
            try:
                return super().save(step, **kwargs)
            finally:
                saved_seconds.append(time.perf_counter() - start)

    checkpoint = TimedCheckpoint(tmp_path, save_every_n_steps=2, async_save=False)
    trainer = trainer_for(callbacks=[checkpoint, Sleeper()])
    trainer.fit(make_batches(6), max_steps=6)
    seen = parts(trainer)
    assert len(saved_seconds) >= 3
    assert seen["checkpoint"] >= sum(saved_seconds)  # the saves, and its other hooks
    assert seen["callbacks"] >= 0.9 * 6 * 0.02  # the sleeper's, not the checkpoint's
    assert seen["callbacks"] < seen["checkpoint"] + 6 * 0.02 * 3
