"""A run saved under PipelineParallel resumes under FSDP x TP, and back: the restored state
is the saved one bit for bit, and the run trains on as the one that never left the pipeline
(within the float rounding of a step computed in another order)."""

import shutil

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from test_pipeline_parallel import LAYERS, batches, initial_state, pipelined_gpt
from test_scan_layers import assert_trees_close
from toy_models import RecordLosses

from nnx_spmd_trainer import FSDP, DataParallel, Hybrid, PipelineParallel, TensorParallel, Trainer
from nnx_spmd_trainer.app.models import gpt
from nnx_spmd_trainer.callbacks import OrbaxCheckpoint

pytestmark = pytest.mark.slow  # four short runs, three of them resumed

PIPELINE = Hybrid(DataParallel(2), PipelineParallel(4))
FSDP_TP = Hybrid(FSDP(4, min_size=16), TensorParallel(2))
TX = optax.sgd(0.5, momentum=0.9)  # a moment per parameter, saved and resumed with it


@pytest.fixture(scope="module", autouse=True)
def _built_once():
    initial_state(LAYERS)  # outside any trace: the trainers first ask for it in theirs


def run(strategy, directory, max_steps):
    recorder = RecordLosses()
    trainer = Trainer(
        pipelined_gpt,
        TX,
        strategy=strategy,
        loss_fn=gpt.loss_fn,
        callbacks=[OrbaxCheckpoint(directory), recorder],
    )
    trainer.fit(batches() * 2, max_steps=max_steps)
    return trainer, recorder.losses


def params(trainer):
    return jax.device_get(nnx.to_pure_dict(nnx.state(trainer.model, nnx.Param)))


def state(trainer):
    pure = nnx.to_pure_dict(trainer.state)
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), pure["optimizer"])


def test_pipeline_checkpoints_resume_under_fsdp_tp_and_back(tmp_path):
    moved, stayed = tmp_path / "moved", tmp_path / "stayed"
    first, _ = run(PIPELINE, moved, 1)
    saved = state(first)
    shutil.copytree(moved, stayed)

    there, there_losses = run(FSDP_TP, moved, 2)  # resumed at step 1 under FSDP x TP
    spec = there.state["model"]["blocks"]["linear1"]["kernel"].get_value().sharding.spec
    assert "stage" not in str(spec)
    back, back_losses = run(PIPELINE, moved, 3)  # and at step 2 under the pipeline again
    assert OrbaxCheckpoint(moved).steps()[-1] == 3

    # The optimizer state restored under FSDP x TP (step count, momenta) is the saved one.
    resumed = Trainer(pipelined_gpt, TX, strategy=FSDP_TP, loss_fn=gpt.loss_fn)
    assert OrbaxCheckpoint(stayed).restore_into(resumed) == 1
    jax.tree.map(np.testing.assert_array_equal, state(resumed), saved)

    reference, reference_losses = run(PIPELINE, stayed, 3)  # never left the pipeline

    np.testing.assert_allclose(there_losses + back_losses, reference_losses, rtol=1e-6)
    assert_trees_close(params(back), params(reference), rtol=1e-6, atol=1e-7)
