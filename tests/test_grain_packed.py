"""Grain's packer output read as it is (issue 47 item 3).

Rows packed by Grain's own ``FirstFitPackIterDataset`` (its field names: ``tokens_segment_ids``,
``inputs_segment_ids``...) become the model batch through ``data.from_grain_packed`` and
train to the same loss and gradients as each document alone (plain JAX, one device), rows
that end inside a document included. Fed unchanged, they fail with one line that says so,
never train as if unpacked.
"""

from __future__ import annotations

import functools

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nnx_spmd_trainer import DataParallel, Trainer, path_str
from nnx_spmd_trainer.app.models import gpt
from nnx_spmd_trainer.data import from_grain_packed
from nnx_spmd_trainer.nn.packed import token_weights

VOCAB, SEQ, ROWS = 16, 8, 8
TINY = dict(vocab_size=VOCAB, seq_len=SEQ, embed_dim=16, num_heads=2, ff_dim=32, num_layers=1)
# Token counts: two fill a row (a row that ends inside its document: the last token's
# target is not in the row), one is longer and truncated to the row, as Grain requires.
LENGTHS = [5, 3, 8, 2, 6, 12, 4, 7, 3, 2, 5]


def documents(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, VOCAB, n, dtype=np.int32)[:SEQ] for n in LENGTHS]


DOCS = documents()


def grain_rows(form: str) -> list[dict[str, np.ndarray]]:
    """Grain's packed rows of DOCS, as its ``FirstFitPackIterDataset`` gives them."""
    if form == "tokens":
        features, lengths = [{"tokens": d} for d in DOCS], {"tokens": SEQ}
    else:  # an (inputs, targets) pair per document: the targets already the next tokens
        features = [{"inputs": d[:-1], "targets": d[1:]} for d in DOCS]
        lengths = {"inputs": SEQ, "targets": SEQ}
    source = grain.MapDataset.source(features).to_iter_dataset()
    packed = grain.experimental.FirstFitPackIterDataset(
        source, length_struct=lengths, num_packing_bins=3, shuffle_bins=False
    )
    return list(packed)


def as_batch(rows: list[dict]) -> dict[str, np.ndarray]:
    """Rows stacked into one batch of ROWS, empty rows (segment 0) added to fill it."""
    assert len(rows) <= ROWS
    empty = {k: np.zeros_like(v) for k, v in rows[0].items()}
    return {k: np.stack([r[k] for r in rows + [empty] * (ROWS - len(rows))]) for k in rows[0]}


def tiny_gpt(rngs: nnx.Rngs) -> gpt.GPT:
    return gpt.GPT(**TINY, dropout_rate=0.0, rngs=rngs)


def each_document_alone(params: dict) -> tuple[float, dict]:
    """Plain JAX on one device: each document in a row of its own from position 0, no
    segment ids; the mean over all documents' next-token targets and its gradient."""
    with nnx.use_eager_sharding(False), jax.default_device(jax.devices()[0]):
        model = tiny_gpt(nnx.Rngs(0))
        state = nnx.state(model, nnx.Param)
        nnx.replace_by_pure_dict(state, jax.device_put(params, jax.devices()[0]))
        nnx.update(model, state)
    rows = np.zeros((len(DOCS), SEQ + 1), np.int32)
    for r, doc in enumerate(DOCS):
        rows[r, : len(doc)] = doc
    real = (np.arange(SEQ)[None, :] < np.array([len(d) - 1 for d in DOCS])[:, None]) * 1.0

    def mean(m: gpt.GPT) -> jax.Array:
        losses = optax.softmax_cross_entropy_with_integer_labels(m(rows[:, :-1]), rows[:, 1:])
        return jnp.sum(losses * real) / real.sum()

    loss, grads = nnx.jit(nnx.value_and_grad(mean))(model)
    return float(loss), nnx.to_pure_dict(grads)


def trainer(loss_fn=gpt.loss_fn) -> Trainer:
    return Trainer(tiny_gpt, optax.sgd(1.0), strategy=DataParallel(), loss_fn=loss_fn)


@functools.cache
def one_step(form: str) -> tuple[float, dict, dict]:
    """One SGD step (learning rate 1) on 8 devices of Grain's rows through the adapter:
    the loss, the gradients (the parameters' change), the parameters before."""
    run = trainer()
    run.log_every_n_steps = 1
    before = jax.device_get(nnx.to_pure_dict(nnx.state(run.model, nnx.Param)))
    batch = as_batch([from_grain_packed(r) for r in grain_rows(form)])
    history = run.fit([batch], max_steps=1).history
    after = jax.device_get(nnx.to_pure_dict(nnx.state(run.model, nnx.Param)))
    grads = jax.tree.map(lambda b, a: np.float64(b) - np.float64(a), before, after)
    return float(history["train/loss"][0]), grads, before


def flat(tree: dict) -> dict[str, np.ndarray]:
    return {path_str(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_grain_names_its_fields_after_the_feature():
    tokens, pair = grain_rows("tokens")[0], grain_rows("pair")[0]
    assert set(tokens) == {"tokens", "tokens_segment_ids", "tokens_positions"}
    assert {"inputs_segment_ids", "targets_positions"} <= set(pair)


@pytest.mark.parametrize("form", ["tokens", "pair"])
def test_the_adapter_trains_each_document_alone(form: str):
    loss, grads, before = one_step(form)
    want_loss, want_grads = each_document_alone(before)
    assert loss == pytest.approx(want_loss, abs=1e-6)
    got, want = flat(grads), flat(want_grads)
    assert got.keys() == want.keys()
    for key, value in want.items():
        np.testing.assert_allclose(got[key], value, atol=1e-6, err_msg=key)


def test_a_row_that_ends_inside_a_document_trains_no_target_past_it():
    rows = grain_rows("tokens")
    batch = as_batch([from_grain_packed(r) for r in rows])
    weights = np.asarray(token_weights(batch))
    assert weights.sum() == sum(len(d) - 1 for d in DOCS)
    full = [r for r, row in enumerate(rows) if (row["tokens_segment_ids"] != 0).all()]
    assert full and not weights[full, -1].any()  # the last target of a full row: weight 0
    # Renamed by hand (no target_segment_ids), such a row trains one dummy target each.
    naive = {k: batch[k] for k in ("inputs", "targets", "segment_ids", "positions")}
    assert np.asarray(token_weights(naive)).sum() == weights.sum() + len(full)


def test_a_weight_feature_becomes_loss_weights():
    row = {
        "tokens": np.array([5, 6, 7, 8]),
        "tokens_segment_ids": np.array([1, 1, 1, 2]),
        "tokens_positions": np.array([0, 1, 2, 0]),
        "mask": np.array([0, 0, 1, 1]),
        "mask_segment_ids": np.array([1, 1, 1, 2]),
        "mask_positions": np.array([0, 1, 2, 0]),
    }
    batch = from_grain_packed(row, inputs="tokens", weights="mask")
    assert set(batch) == {"inputs", "targets", "segment_ids", "positions"} | {
        "target_segment_ids",
        "loss_weights",
    }
    # The weight of predicting token t + 1; the last target of the row and of document 1: 0.
    np.testing.assert_array_equal(np.asarray(token_weights(batch)), [0, 1, 0, 0])


def fit_error(batch: dict, loss_fn=gpt.loss_fn) -> ValueError:
    with pytest.raises(ValueError) as caught:
        trainer(loss_fn).fit([batch], max_steps=1)
    message = str(caught.value)
    assert "\n" not in message, message
    return caught.value


def test_grain_token_rows_fed_unchanged_name_the_keys_they_have_and_need():
    batch = as_batch(grain_rows("tokens"))
    message = str(fit_error(batch))
    assert "['inputs', 'targets']" in message and "'tokens_segment_ids'" in message
    assert "from_grain_packed" in message

    def own_loss(model, batch):  # a loss of one's own: the step names the key it lacks
        logits = model(batch["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean(), {}

    error = fit_error(batch, own_loss)
    assert isinstance(error, KeyError)  # still a KeyError to a loss that catches one
    assert "batch['inputs']" in str(error) and "'tokens_positions'" in str(error)


def test_grain_pair_rows_fed_unchanged_are_refused_not_trained_unpacked():
    batch = as_batch(grain_rows("pair"))
    message = str(fit_error(batch))
    assert "inputs_segment_ids" in message and "from_grain_packed" in message

    def unpacked_loss(model, batch):  # reads inputs and targets only, as before packing
        logits = model(batch["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean(), {}

    message = str(fit_error(batch, unpacked_loss))
    assert "never read" in message and "'inputs_segment_ids'" in message


def test_segment_ids_to_a_loss_that_ignores_them_are_refused():
    batch = as_batch([from_grain_packed(r) for r in grain_rows("tokens")])

    def ignoring_loss(model, batch):
        logits = model(batch["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean(), {}

    message = str(fit_error(batch, ignoring_loss))
    assert "never read" in message
    assert "['positions', 'segment_ids', 'target_segment_ids']" in message
