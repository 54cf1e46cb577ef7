"""DPO in two forward passes a step (chosen and rejected rows together, once for the policy
and once for the reference), the reference given as another model, its log-probabilities
precomputed before training (equal to the live reference's bit for bit, read back on a
resume), and an evaluation split reporting TRL's reward metrics against the papers'
formulas (``test_dpo.plain_loss``, a one-device loop written from them)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_dpo import BETA, FSDP_TP, METRICS, SEQ, flat, make_model, plain_loss, toy_batches

from nnx_spmd_trainer import DataParallel
from nnx_spmd_trainer.app.models import gpt
from nnx_spmd_trainer.post_training import DPOTrainer, ReferenceModel

ROWS = 8  # pairs a batch (test_dpo's toy batches)


class CountingGPT(gpt.GPT):
    """The GPT, recording the rows of each forward pass it is traced through."""

    passes: list[int] = []

    def features(self, tokens, segment_ids=None, positions=None):
        CountingGPT.passes.append(tokens.shape[0])
        return super().features(tokens, segment_ids, positions)


def counting_model(rngs: nnx.Rngs) -> CountingGPT:
    return CountingGPT(16, SEQ, 32, 2, 64, 1, 0.0, rngs)


def trainer_for(strategy=FSDP_TP, model=make_model, **kwargs) -> DPOTrainer:
    return DPOTrainer(
        model, optax.sgd(0.5), beta=BETA, strategy=strategy, log_every_n_steps=1, **kwargs
    )


def test_one_forward_pass_per_model_per_step():
    """Each traced program (the step's loss, the reference's) runs the model once, over
    both sides' rows (2 x 8); no pass of 8 rows (one side alone) is ever traced."""
    trainer = trainer_for(model=counting_model)
    batches = toy_batches(2, seed=5)
    trainer.fit(batches, max_steps=2)
    assert CountingGPT.passes and set(CountingGPT.passes) == {2 * ROWS}, CountingGPT.passes
    placed = trainer.placement.place(batches[0])
    with jax.set_mesh(trainer.plan.mesh):
        batch = trainer.prepare_batch(placed)
        for program in (trainer.loss_fn, trainer._reference_pass):
            CountingGPT.passes.clear()
            jax.make_jaxpr(lambda b, f=program: f(trainer.model, b))(batch)
            assert CountingGPT.passes == [2 * ROWS], (program, CountingGPT.passes)


@pytest.fixture(scope="module")
def live_run():
    batches = toy_batches(3, seed=6)
    trainer = trainer_for()
    trainer.fit(batches, max_steps=3)
    return trainer, batches


def test_precomputed_reference_equals_the_live_one_bitwise_and_is_read_back(live_run, tmp_path):
    live, batches = live_run
    path = tmp_path / "run" / "reference_logps.npz"
    trainer = trainer_for(precompute_ref_log_probs=True)
    with pytest.raises(ValueError, match="precompute_reference_logps"):
        trainer.fit(batches, max_steps=1)
    table = trainer.precompute_reference_logps(reversed(batches), path=path)  # any order
    assert path.exists() and len(table) == 3 * ROWS
    for batch in batches:  # the live reference, as training computes it
        with jax.set_mesh(live.plan.mesh):
            values = jax.device_get(live.reference_logps(live.placement.place(batch)))
        for key, got in zip(ReferenceModel.KEYS, table.lookup(batch), strict=True):
            np.testing.assert_array_equal(got, np.asarray(values[key]), err_msg=key)
    trainer.fit(batches, max_steps=3)
    assert trainer._reference is None  # never built: every value came from the table
    assert trainer.history.history["train/loss"] == live.history.history["train/loss"]
    want = flat(jax.device_get(nnx.to_pure_dict(nnx.state(live.model, nnx.Param))))
    got = flat(jax.device_get(nnx.to_pure_dict(nnx.state(trainer.model, nnx.Param))))
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    # A resumed run reads the file back: the reference is not run again.
    resumed = trainer_for(precompute_ref_log_probs=True)
    again = resumed.precompute_reference_logps(batches, path=path)
    assert resumed._reference is None and len(again) == len(table)
    for batch in batches:
        for a, b in zip(again.lookup(batch), table.lookup(batch), strict=True):
            np.testing.assert_array_equal(a, b)
    with pytest.raises(KeyError, match="no values for row 0"):
        again.lookup(toy_batches(1, seed=99)[0])


def other_model() -> nnx.Module:
    """The same architecture from another seed: a reference that is not the policy."""
    with nnx.use_eager_sharding(False):
        return make_model(nnx.Rngs(7))


def test_another_model_as_reference_and_an_evaluation_split():
    """reference=<another GPT>: laid out as the policy, its values; ``evaluate`` over an
    evaluation split of pairs reports the loss and TRL's metrics as the one-device
    formulas give them for the starting policy against that reference."""
    reference = other_model()
    trainer = trainer_for(reference=reference)
    state = trainer.reference.state
    policy = nnx.state(trainer.model)
    for (path, mine), (_, theirs), (_, given) in zip(
        *(
            jax.tree_util.tree_flatten_with_path(s)[0]
            for s in (policy, state, nnx.state(reference))
        ),
        strict=True,
    ):
        assert theirs.sharding == mine.sharding, path
        if jnp.issubdtype(given.dtype, jax.dtypes.prng_key):
            continue
        np.testing.assert_array_equal(np.asarray(theirs), np.asarray(given))
    batches = toy_batches(2, seed=8)
    logs = trainer.evaluate(batches)

    graphdef, params, rest = nnx.split(other_model(), nnx.Param, ...)
    start = jax.device_get(nnx.to_pure_dict(nnx.state(trainer.model, nnx.Param)))
    policy_params = jax.tree.map(lambda x: x, params)
    nnx.replace_by_pure_dict(policy_params, jax.tree.map(jnp.asarray, start))
    want = [
        plain_loss(policy_params, params, rest, graphdef, b, "sigmoid", 0.0, BETA) for b in batches
    ]
    np.testing.assert_allclose(logs["loss"], np.mean([w[0] for w in want]), atol=1e-5)
    for name in METRICS:
        expected = np.mean([float(w[1][name]) for w in want])
        np.testing.assert_allclose(logs[name], expected, atol=1e-5, err_msg=name)
    assert abs(logs["rewards/margins"]) > 1e-3  # a reference that is not the policy


def test_a_reference_of_another_shape_is_refused():
    with nnx.use_eager_sharding(False):
        wider = gpt.GPT(16, SEQ, 48, 2, 64, 1, 0.0, nnx.Rngs(0))
    trainer = trainer_for(DataParallel(), reference=wider)
    with pytest.raises(ValueError, match="not laid out as the policy: at .*the reference has"):
        _ = trainer.reference


def test_whole_logits_are_one_note_in_the_plan_report():
    """A trainer whose log-probabilities cannot be chunked (``logits_fn``, or a model
    without the protocol) says so once in its plan's report; the shipped GPT, nothing."""
    chunked = trainer_for(strategy=DataParallel())
    assert chunked.log_prob_note is None
    whole = trainer_for(strategy=DataParallel(), logits_fn=lambda model, inputs: model(inputs))
    note = whole.log_prob_note
    assert note is not None and note.startswith("DPOTrainer(logits_fn=...)")
    shapes = {"x": jax.ShapeDtypeStruct((8, 4), jnp.float32)}
    plan = nnx_plan()
    report = plan.report(shapes, notes=[note, None, chunked.log_prob_note])
    assert report.notes == [note]
    assert str(report).count("note: ") == 1 and f"note: {note}" in str(report)
    assert plan.report(shapes).notes == []
    assert plan.report(shapes, notes=note).notes == [note]  # one note, not its letters


def nnx_plan():
    """A small plan of its own: the report's notes are the caller's, whatever the step."""
    from nnx_spmd_trainer import Plan

    def loss_fn(model, batch):
        return jnp.mean(model(batch["x"]) ** 2), {}

    return Plan(lambda rngs: nnx.Linear(4, 2, rngs=rngs), optax.sgd(0.1), loss_fn=loss_fn,
                strategy=DataParallel())  # fmt: skip
