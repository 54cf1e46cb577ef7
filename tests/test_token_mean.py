"""The token mean (issue 47 item 2): the loss and gradients of a step are the mean over the
whole batch's trained tokens, whatever the gradient-accumulation split.

Packed rows (and rows with ``loss_weights``) whose microbatches train different numbers
of tokens: a mean of the microbatches' means (the rule before) changes with
``grad_accum_steps``; the step now weights each microbatch by the trained tokens' weight
the loss reports (``aux[TOKEN_WEIGHT]``). The reference is plain JAX on one device: each
document alone (packed) or each row with its weights (weighted), summed over the batch's
tokens and divided by their total weight.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_spmd_trainer import DataParallel, Trainer, path_str
from nnx_spmd_trainer.app.models import gpt
from nnx_spmd_trainer.nn.packed import token_weights
from nnx_spmd_trainer.planner.step import TOKEN_WEIGHT, compute_gradients

VOCAB, SEQ, ROWS = 16, 8, 32
TINY = dict(vocab_size=VOCAB, seq_len=SEQ, embed_dim=16, num_heads=2, ff_dim=32, num_layers=1)
# Documents (token counts) packed in each row of SEQ + 1 tokens, by row % 4: under
# grad_accum_steps=k, row r * k + j goes to microbatch j, so the microbatches of k = 2
# and of k = 4 train 8+7, 3+1 and 8, 3, 7, 1 targets per row.
LAYOUTS = [[9], [2, 3], [4, 5], [2]]


def documents(seed: int = 0) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        [rng.integers(1, VOCAB, n, dtype=np.int32) for n in LAYOUTS[r % 4]] for r in range(ROWS)
    ]


def packed_batch(rows: list[list[np.ndarray]]) -> dict[str, np.ndarray]:
    """Rows packed by hand: inputs and targets the row of SEQ + 1 tokens shifted by one."""
    tokens, segments, positions = (np.zeros((len(rows), SEQ + 1), np.int32) for _ in range(3))
    for r, docs in enumerate(rows):
        start = 0
        for s, doc in enumerate(docs, start=1):
            end = start + len(doc)
            tokens[r, start:end], segments[r, start:end] = doc, s
            positions[r, start:end] = np.arange(len(doc))
            start = end
    return {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "segment_ids": segments[:, :-1],
        "positions": positions[:, :-1],
    }


def weighted_batch(seed: int = 1) -> dict[str, np.ndarray]:
    """Unpacked rows whose targets carry ``loss_weights``: by row % 4, 8, 3, 6 or none of
    them (the last ones: a chat row's answer), every third row at weight 0.5."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, (ROWS, SEQ + 1), dtype=np.int32)
    weights = np.zeros((ROWS, SEQ), np.float32)
    for r in range(ROWS):
        trained = [8, 3, 6, 0][r % 4]
        weights[r, SEQ - trained :] = 1.0 if r % 3 else 0.5
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_weights": weights}


DOCS = documents()
BATCHES = {"packed": packed_batch(DOCS), "weighted": weighted_batch()}


def tiny_gpt(rngs: nnx.Rngs) -> gpt.GPT:
    return gpt.GPT(**TINY, dropout_rate=0.0, rngs=rngs)


def one_device_model(params: dict) -> gpt.GPT:
    """The GPT holding ``params`` (a pure dict), on one device."""
    with nnx.use_eager_sharding(False), jax.default_device(jax.devices()[0]):
        model = tiny_gpt(nnx.Rngs(0))
        state = nnx.state(model, nnx.Param)
        nnx.replace_by_pure_dict(state, jax.device_put(params, jax.devices()[0]))
        nnx.update(model, state)
    return model


def reference(params: dict, kind: str) -> tuple[float, dict]:
    """Plain JAX on one device: the batch's token mean and its gradient."""
    model = one_device_model(params)
    if kind == "packed":
        docs = [doc for row in DOCS for doc in row]
        rows = np.zeros((len(docs), SEQ + 1), np.int32)
        for r, doc in enumerate(docs):
            rows[r, : len(doc)] = doc
        inputs, targets = rows[:, :-1], rows[:, 1:]
        # Each document alone from position 0: its n - 1 targets, nothing after them.
        weights = (np.arange(SEQ)[None, :] < np.array([len(d) - 1 for d in docs])[:, None]) * 1.0
    else:
        batch = BATCHES["weighted"]
        inputs, targets, weights = batch["inputs"], batch["targets"], batch["loss_weights"]

    def mean(m: gpt.GPT) -> jax.Array:
        losses = optax.softmax_cross_entropy_with_integer_labels(m(inputs), targets)
        return jnp.sum(losses * weights) / np.sum(weights)

    loss, grads = nnx.jit(nnx.value_and_grad(mean))(model)
    return float(loss), nnx.to_pure_dict(grads)


def flat(tree: dict) -> dict[str, np.ndarray]:
    return {path_str(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


@functools.cache
def trained(kind: str, accum: int) -> tuple[float, dict, dict]:
    """One SGD step (learning rate 1) of the Trainer on 8 devices: the step's loss, and
    its gradients as the parameters' change; with the parameters before it."""
    trainer = Trainer(
        tiny_gpt,
        optax.sgd(1.0),
        strategy=DataParallel(),
        loss_fn=gpt.loss_fn,
        grad_accum_steps=accum,
        log_every_n_steps=1,
    )
    before = jax.device_get(nnx.to_pure_dict(nnx.state(trainer.model, nnx.Param)))
    history = trainer.fit([BATCHES[kind]], max_steps=1).history
    after = jax.device_get(nnx.to_pure_dict(nnx.state(trainer.model, nnx.Param)))
    grads = jax.tree.map(
        lambda b, a: np.asarray(b, np.float64) - np.asarray(a, np.float64), before, after
    )
    return float(history["train/loss"][0]), grads, before


def test_the_microbatches_train_different_token_counts():
    """What makes the split matter: per microbatch of k = 2 and k = 4, unequal counts."""
    for batch in BATCHES.values():
        weights = np.asarray(token_weights(batch))
        for k in (2, 4):
            per_microbatch = [weights[j::k].sum() for j in range(k)]
            assert len(set(per_microbatch)) == k, per_microbatch


@pytest.mark.parametrize("kind", ["packed", "weighted"])
@pytest.mark.parametrize("accum", [1, 2, 4])
def test_loss_and_gradients_are_the_batch_token_mean(kind: str, accum: int):
    loss, grads, before = trained(kind, accum)
    want_loss, want_grads = reference(before, kind)
    assert loss == pytest.approx(want_loss, abs=1e-6)
    got, want = flat(grads), flat(want_grads)
    assert got.keys() == want.keys()
    for key, value in want.items():
        np.testing.assert_allclose(got[key], value, atol=1e-6, err_msg=key)


def test_a_loss_of_ones_own_takes_part_through_aux():
    """A user's loss reporting ``aux[TOKEN_WEIGHT]``: the step's loss and gradient are the
    mean over the batch's weighted values for k = 4, and ``aux`` holds the batch's weight."""
    mesh = DataParallel().make_mesh()
    values = np.arange(ROWS * 2, dtype=np.float32).reshape(ROWS, 2)
    weights = np.zeros((ROWS, 2), np.float32)
    weights[::4] = 1.0  # microbatch 0 of 4 holds every weighted value
    weights[1::4, 0] = 1.0  # microbatch 1 one per row; microbatches 2 and 3 none
    batch = {"v": values, "w": weights}
    sharding = {key: NamedSharding(mesh, P("data")) for key in batch}
    batch = jax.device_put(batch, sharding)

    class Scale(nnx.Module):
        def __init__(self) -> None:
            self.a = nnx.Param(jnp.ones(()))

    def loss_fn(model: nnx.Module, batch: dict) -> tuple[jax.Array, dict]:
        total = batch["w"].sum()
        mean = (model.a[...] ** 2 * batch["v"] * batch["w"]).sum() / jnp.maximum(total, 1e-9)
        return mean, {TOKEN_WEIGHT: total}

    graphdef, state = nnx.split(Scale())

    @jax.jit
    def run(state: nnx.State, batch: dict) -> tuple[jax.Array, dict, nnx.State]:
        return compute_gradients(
            nnx.merge(graphdef, state), batch, loss_fn, grad_accum_steps=4, batch_sharding=sharding
        )

    loss, aux, grads = run(state, batch)
    want = (values * weights).sum() / weights.sum()
    assert float(loss) == pytest.approx(want, rel=1e-6)
    assert float(grads["a"][...]) == pytest.approx(2 * want, rel=1e-6)
    assert float(aux[TOKEN_WEIGHT]) == weights.sum()
