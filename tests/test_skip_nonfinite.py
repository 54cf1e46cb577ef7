"""skip_nonfinite_updates: a step whose loss is not finite changes nothing, so the weights
left in memory (a TerminateOnNaN stop included) are those of the finite steps.

The reference is plain optax on one device over the same batches without the
non-finite one (``train_reference``): what ``optax.apply_if_finite`` computes.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from toy_models import (
    Net,
    RecordLosses,
    assert_params_match,
    classification_loss,
    make_batches,
    train_reference,
)

from nnx_spmd_trainer import FSDP, Hybrid, TensorParallel, Trainer
from nnx_spmd_trainer.callbacks import OrbaxCheckpoint, TerminateOnNaN

NAN_AT = 2  # the batch of step 3


def scaled_loss(model, batch):
    """The classification loss times the batch's ``scale``: NaN poisons one known step."""
    loss, aux = classification_loss(model, batch)
    return loss * batch["scale"].mean(), aux


def batches(n: int) -> list[dict[str, np.ndarray]]:
    made = make_batches(n)
    for i, batch in enumerate(made):
        batch["scale"] = np.full((16,), np.nan if i == NAN_AT else 1.0, np.float32)
    return made


def finite_only(made: list[dict]) -> list[dict]:
    return [batch for i, batch in enumerate(made) if i != NAN_AT]


def test_terminate_on_nan_leaves_the_weights_of_the_finite_steps_in_memory():
    guard, record = TerminateOnNaN(), RecordLosses()
    tx = optax.adam(1e-2)  # its moments and bias-correction count must skip the step too
    trainer = Trainer(
        Net, tx, loss_fn=scaled_loss, callbacks=[guard, record], skip_nonfinite_updates=True
    )
    made = batches(8)
    with pytest.warns(
        RuntimeWarning, match=r"at step 3.*skip_nonfinite_updates.*finite steps up to step 5"
    ):
        trainer.fit(made, max_steps=8)
    # stopped once step 3's loss was read, two steps in flight later; steps 4 and 5 trained
    assert guard.stopped_step == 3 and trainer.step == 5
    assert int(np.asarray(trainer.optimizer.step[...])) == 5  # the count moved on: in sync
    params, losses = train_reference(Net, tx, finite_only(made[:5]), scaled_loss)
    assert_params_match(trainer, params, rtol=1e-5)
    assert np.isnan(record.losses[NAN_AT])
    finite = finite_only(record.losses)
    np.testing.assert_allclose(finite, losses, rtol=1e-5)


def test_a_skipped_step_under_fsdp_x_tp_with_accumulation_trains_on_like_optax_without_it():
    record = RecordLosses()
    trainer = Trainer(
        Net,
        optax.sgd(0.1),
        strategy=Hybrid(FSDP(4), TensorParallel(2)),
        loss_fn=scaled_loss,
        grad_accum_steps=2,
        callbacks=[record],
        skip_nonfinite_updates=True,
    )
    made = batches(5)
    trainer.fit(made, max_steps=5)
    assert trainer.step == 5
    params, losses = train_reference(Net, optax.sgd(0.1), finite_only(made), scaled_loss)
    assert_params_match(trainer, params, rtol=1e-5)
    np.testing.assert_allclose(finite_only(record.losses), losses, rtol=1e-5)


def test_a_checkpoint_after_a_skipped_nan_step_saves_the_finite_weights(tmp_path):
    # Before: OrbaxCheckpoint refused every save after a non-finite loss, even when the
    # skipped step had left the weights finite.
    guard = TerminateOnNaN()
    checkpoint = OrbaxCheckpoint(tmp_path, save_every_n_steps=100, async_save=False)
    trainer = Trainer(
        Net,
        optax.sgd(0.1),
        loss_fn=scaled_loss,
        callbacks=[guard, checkpoint],
        skip_nonfinite_updates=True,
    )
    made = batches(8)
    with pytest.warns(RuntimeWarning, match=r"at step 3.*skip_nonfinite_updates"):
        trainer.fit(made, max_steps=8)
    assert checkpoint.steps() == [trainer.step]  # the final save, after the stop
    restored = Trainer(
        Net,
        optax.sgd(0.1),
        loss_fn=scaled_loss,
        callbacks=[OrbaxCheckpoint(tmp_path, async_save=False)],
    )
    restored.fit(made[:0], max_steps=trainer.step)  # restores, trains nothing
    params, _ = train_reference(Net, optax.sgd(0.1), finite_only(made[: trainer.step]), scaled_loss)
    assert_params_match(restored, params, rtol=1e-5)


def test_the_cli_key_turns_it_on_and_a_diverged_run_still_saves_finite_weights(tmp_path):
    # Before: no config key; and OrbaxCheckpoint refused every save after the NaN step.
    from test_cli import load, shrink

    from nnx_spmd_trainer.app import job

    config = shrink(load("mlp"))
    config.update(skip_nonfinite_updates=True, learning_rate=1e30, max_steps=4)
    with pytest.warns(RuntimeWarning, match="skip_nonfinite_updates"):
        result = job.run(config, tmp_path / "run")
    assert result.trainer.plan.skip_nonfinite_updates
    params = jax.tree.leaves(nnx.state(result.trainer.model, nnx.Param))
    assert all(np.isfinite(np.asarray(p)).all() for p in params)
    saved = OrbaxCheckpoint(tmp_path / "run" / "checkpoints").steps()
    assert saved and saved[-1] == result.trainer.step
