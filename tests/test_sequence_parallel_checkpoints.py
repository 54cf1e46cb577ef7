"""Checkpoints move between SequenceParallel and the other strategies, exactly.

A tiny GPT saved at step 3 under one layout resumes under another to step 6:
the state it restores is the saved one bit for bit, already in the new
layout, and the resumed steps give the losses and parameters of the run that
never stopped (which is itself one device's, plain optax).
"""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from toy_models import RecordLosses, flat_params, train_reference

from nnx_spmd_trainer import FSDP, Hybrid, SequenceParallel, TensorParallel, Trainer
from nnx_spmd_trainer.app.models import GPT, gpt
from nnx_spmd_trainer.callbacks import LambdaCallback, OrbaxCheckpoint

VOCAB, SEQ, ROWS, STEPS, SAVE_AT = 16, 16, 4, 6, 3
TINY = dict(seq_len=SEQ, embed_dim=16, num_heads=4, ff_dim=32, num_layers=1)
FSDP_SEQ = Hybrid(FSDP(2, min_size=1), SequenceParallel(4))
FSDP_TP = Hybrid(FSDP(4, min_size=1), TensorParallel(2))
FSDP_RING = Hybrid(FSDP(2, min_size=1), SequenceParallel(4, attention="ring"))  # issue 31


def tiny_gpt(rngs):
    return GPT(vocab_size=VOCAB, dropout_rate=0.0, rngs=rngs, **TINY)


def gpt_loss(model, batch):
    return gpt.loss_fn(model, batch)


def token_batches(n):
    rng = np.random.default_rng(3)
    windows = (rng.integers(0, VOCAB, size=(ROWS, SEQ + 1), dtype=np.int32) for _ in range(n))
    return [{"inputs": w[:, :-1], "targets": w[:, 1:]} for w in windows]


def optimizer():
    # SGD with momentum: optimizer state moves too. Not Adam (PITFALLS: it amplifies the
    # float noise of the key bias's zero gradient).
    return optax.sgd(0.5, momentum=0.9)


def trainer_for(strategy, callbacks):
    return Trainer(tiny_gpt, optimizer(), strategy=strategy, loss_fn=gpt_loss, callbacks=callbacks)


def params(trainer):
    return flat_params(nnx.state(trainer.model, nnx.Param))


def host(x):
    """A leaf as a NumPy array (an RNG key as its key data)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


@pytest.fixture(scope="module")
def reference():
    return train_reference(tiny_gpt, optimizer(), token_batches(STEPS), loss_fn=gpt_loss)


@pytest.mark.parametrize(
    ("saved_under", "resumed_under"),
    [(FSDP_SEQ, FSDP_TP), (FSDP_TP, FSDP_SEQ), (FSDP_TP, FSDP_RING)],
    ids=["fsdp2-seq4-to-fsdp4-tp2", "fsdp4-tp2-to-fsdp2-seq4", "fsdp4-tp2-to-fsdp2-ring4"],
)
def test_a_run_saved_under_one_layout_resumes_under_another_exactly(
    tmp_path, saved_under, resumed_under, reference
):
    batches = token_batches(STEPS)
    whole = RecordLosses()
    writer = trainer_for(
        saved_under, [OrbaxCheckpoint(tmp_path, save_every_n_steps=SAVE_AT), whole]
    )
    writer.fit(batches[:SAVE_AT], max_steps=SAVE_AT)
    saved = jax.device_get(writer.state)
    writer.fit(batches[SAVE_AT:], max_steps=STEPS)  # the run that never stopped

    restored: list = []
    after = RecordLosses()
    checkpoint = OrbaxCheckpoint(tmp_path / "moved", restore=tmp_path / str(SAVE_AT))
    moved = trainer_for(
        resumed_under,
        [
            checkpoint,
            LambdaCallback(  # what on_fit_start restored, before training donates it
                on_train_begin=lambda logs: restored.append(jax.device_get(moved.state))
            ),
            after,
        ],
    )
    with pytest.warns(UserWarning, match=f"first {SAVE_AT} batches are read and discarded"):
        moved.fit(batches, max_steps=STEPS)
    assert checkpoint.restored_step == SAVE_AT and moved.step == STEPS

    # Restored bit for bit, every leaf delivered in the new layout.
    assert checkpoint.restored_layouts == moved.plan.leaf_shardings
    (state,) = restored
    for (path, want), got in zip(
        jax.tree_util.tree_flatten_with_path(saved)[0], jax.tree.leaves(state), strict=True
    ):
        np.testing.assert_array_equal(host(got), host(want), err_msg=jax.tree_util.keystr(path))

    # The resumed steps are the uninterrupted run's (float32 reduction order aside) ...
    np.testing.assert_allclose(after.losses, whole.losses[SAVE_AT:], rtol=1e-6, atol=1e-6)
    got, want = params(moved), params(writer)
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key)
    # ... and both are one device's.
    ref_params, ref_losses = reference
    np.testing.assert_allclose(whole.losses, ref_losses, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(after.losses, ref_losses[SAVE_AT:], rtol=1e-5, atol=1e-5)
    ref = flat_params(ref_params)
    for key in ref:
        np.testing.assert_allclose(got[key], ref[key], rtol=1e-4, atol=1e-5, err_msg=key)
