"""Packed rows (issue 39): documents packed into rows with ``segment_ids`` and
``positions`` never see each other, in every form of attention the library ships.

The reference is independent of packing and of the library's strategies: each
document (each piece of a document split across rows) run alone, one short
sequence at a time, on one device, without segment ids. Packed rows, under
DataParallel, Hybrid(FSDP, TensorParallel), SequenceParallel in both forms and
PipelineParallel with the scanned GPT, give the same per-token losses and the
same gradients of ``gpt.loss_fn``; with the segment ids dropped they do not.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_gpu import HAS_GPU, on_gpu

from nnx_spmd_trainer import (
    FSDP,
    DataParallel,
    Hybrid,
    PipelineParallel,
    SequenceParallel,
    TensorParallel,
    Trainer,
    path_str,
)
from nnx_spmd_trainer.app import tasks
from nnx_spmd_trainer.app.models import gpt
from nnx_spmd_trainer.app.models.gpt2_hf import GPT2, GPT2Config
from nnx_spmd_trainer.nn.attention import causal_attention
from nnx_spmd_trainer.nn.ring_attention import SKIP, ring_attention, ring_schedule

VOCAB, SEQ = 16, 16
TINY = dict(vocab_size=VOCAB, seq_len=SEQ, embed_dim=32, num_heads=4, ff_dim=64, num_layers=2)
# Token counts of the documents packed in each row of SEQ + 1 tokens (inputs and targets are
# the row shifted by one). "C" is split: its first 3 tokens end row 0, its other 10 start
# row 1 as a segment of their own at position 0. Unequal lengths; a row a document fills.
LAYOUT = [[5, 9, 3], [10, 4], [17], [6, 7]]


def documents(seed):
    """The pieces of LAYOUT, row by row, as random token arrays."""
    rng = np.random.default_rng(seed)
    return [[rng.integers(0, VOCAB, size=n, dtype=np.int32) for n in row] for row in LAYOUT]


PIECES = documents(0) + documents(1)  # 8 rows: every strategy below divides them


def batch_of(rows):
    """Rows of documents packed left to right, padded with segment 0, as a model batch."""
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


PACKED = batch_of(PIECES)
UNPACKED = batch_of([[doc] for row in PIECES for doc in row])  # one piece per row, padded


def built(factory):
    with nnx.use_eager_sharding(False):
        return nnx.jit(lambda: factory(nnx.Rngs(0)))()


@functools.cache
def initial_state():
    return nnx.to_pure_dict(nnx.state(built(lambda r: gpt.GPT(**TINY, dropout_rate=0.0, rngs=r))))


def holding_initial_state(rngs, scan=False):
    """The GPT every run starts from (the same state, unrolled or stacked)."""
    del rngs
    model = gpt.GPT(**TINY, dropout_rate=0.0, rngs=nnx.Rngs(1), scan_layers=scan)
    state = nnx.state(model)
    nnx.replace_by_pure_dict(state, gpt.stack_blocks(initial_state()) if scan else initial_state())
    nnx.update(model, state)
    return model


def token_losses(model, batch, **dropped):
    """Per-token cross entropy ``[rows, SEQ]`` of the model on ``batch``."""
    kwargs = {k: batch[k] for k in ("segment_ids", "positions") if k not in dropped}
    logits = model(batch["inputs"], **kwargs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])


def trained_losses(per_token, batch):
    """The per-token losses the loss trains on, document by document, in reading order."""
    weights = np.asarray(gpt.target_weights(batch))
    return np.asarray(per_token)[weights]


@pytest.fixture(scope="module", autouse=True)
def _built_once():
    """Builds ``initial_state`` outside any trace: the trainers first ask for it in theirs."""
    initial_state()


@pytest.fixture(scope="module")
def reference():
    """Each piece alone in a row from position 0, one device, no segment ids, no positions:
    its per-token losses in reading order, and the gradient of their mean. (A causal model's
    output at a token does not depend on the tokens after it, so the row's tail after the
    piece, zeros here, changes nothing; one shape, one compile.)"""
    model = built(holding_initial_state)
    docs = [doc for row in PIECES for doc in row]
    rows = np.zeros((len(docs), SEQ + 1), np.int32)
    for r, doc in enumerate(docs):
        rows[r, : len(doc)] = doc
    real = np.arange(SEQ)[None, :] < np.array([len(d) - 1 for d in docs])[:, None]

    def total(m):
        losses = optax.softmax_cross_entropy_with_integer_labels(m(rows[:, :-1]), rows[:, 1:])
        return jnp.sum(jnp.where(real, losses, 0.0)) / real.sum(), losses

    (_, losses), grads = nnx.jit(nnx.value_and_grad(total, has_aux=True))(model)
    return np.asarray(losses)[real], nnx.to_pure_dict(grads)


def assert_grads_close(got, want, scan=False):
    want = gpt.stack_blocks(want) if scan else want
    flat_got = {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(got)[0]}
    flat_want = {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(want)[0]}
    assert flat_got.keys() == flat_want.keys()
    for key, value in flat_want.items():
        np.testing.assert_allclose(np.asarray(flat_got[key]), value, atol=1e-5, err_msg=key)


def test_the_layout_packs_unequal_documents_and_splits_one():
    assert [len(p) for p in PIECES[0]] == [5, 9, 3] and PACKED["inputs"].shape == (8, SEQ)
    assert PACKED["positions"][1, :10].tolist() == list(range(10))  # the continuation
    assert (PACKED["segment_ids"] == 0).any() and (PACKED["segment_ids"][2] == 1).all()
    weights = np.asarray(gpt.target_weights(PACKED))
    # Every piece of n tokens trains n - 1 targets: none across a boundary, none on padding.
    assert weights.sum() == sum(len(d) - 1 for row in PIECES for d in row)
    assert not weights[0, 4] and weights[0, 3]  # the last token of the first document


def test_unpacked_and_padded_equals_each_document_alone(reference):
    losses, grads = reference
    model = built(holding_initial_state)
    value_and_grad = nnx.value_and_grad(lambda m, b: gpt.loss_fn(m, b)[0])
    per_token, (loss, got) = nnx.jit(lambda m, b: (token_losses(m, b), value_and_grad(m, b)))(
        model, UNPACKED
    )
    np.testing.assert_allclose(trained_losses(per_token, UNPACKED), losses, atol=1e-5)
    np.testing.assert_allclose(float(loss), losses.mean(), atol=1e-6)
    assert_grads_close(nnx.to_pure_dict(got), grads)


def test_the_chunked_loss_counts_the_same_targets(reference):
    losses, _ = reference
    model = built(holding_initial_state)
    chunked = functools.partial(gpt.chunked_loss_fn, chunk_size=4)
    loss = nnx.jit(lambda m, b: chunked(m, b)[0])(model, PACKED)
    np.testing.assert_allclose(float(loss), losses.mean(), atol=1e-6)


def packed_run(strategy, scan=False):
    """Per-token losses and ``gpt.loss_fn``'s gradients on the packed rows, traced as the
    Trainer traces its step under ``strategy`` (its mesh, layouts and trace context)."""
    factory = functools.partial(holding_initial_state, scan=scan)
    trainer = Trainer(factory, optax.sgd(0.1), strategy=strategy, loss_fn=gpt.loss_fn)
    mesh, model = trainer.mesh, trainer.model
    value_and_grad = nnx.value_and_grad(lambda m, b: gpt.loss_fn(m, b)[0])

    def run(model, batch):
        with strategy.trace_context(mesh):
            return token_losses(model, batch), value_and_grad(model, batch)

    with jax.set_mesh(mesh):
        placed = trainer.placement.place(PACKED)
        per_token, (loss, grads) = nnx.jit(run)(model, placed)
    return np.asarray(per_token), float(loss), nnx.to_pure_dict(grads)


STRATEGIES = pytest.mark.parametrize(
    ("strategy", "scan"),
    [
        pytest.param(DataParallel(8), False, id="dp8"),
        pytest.param(Hybrid(FSDP(4, min_size=1), TensorParallel(2)), False, id="fsdp4-tp2"),
        pytest.param(Hybrid(DataParallel(2), SequenceParallel(4)), False, id="seq4-all_gather"),
        pytest.param(
            Hybrid(DataParallel(2), SequenceParallel(4, attention="ring")), False, id="seq4-ring"
        ),
        pytest.param(Hybrid(DataParallel(4), PipelineParallel(2)), True, id="dp4-pp2-scanned"),
    ],
)


@STRATEGIES
def test_packed_equals_each_document_alone(strategy, scan, reference):
    losses, grads = reference
    per_token, loss, got = packed_run(strategy, scan)
    np.testing.assert_allclose(trained_losses(per_token, PACKED), losses, atol=1e-5)
    np.testing.assert_allclose(loss, losses.mean(), atol=1e-6)
    assert_grads_close(got, grads, scan)


def test_the_accuracy_counts_the_trained_targets_alone():
    """Each piece alone (no segments, its row's tail left out) against the packed rows,
    padding and the targets across boundaries in them, through the Trainer's metrics."""
    model = built(holding_initial_state)
    docs = [doc for row in PIECES for doc in row]
    forward = nnx.jit(lambda m, tokens: m(tokens))  # a program a length, not an op at a time
    alone = [np.asarray(forward(model, doc[None, :-1])).argmax(-1)[0] == doc[1:] for doc in docs]
    want = np.concatenate(alone).mean()
    trainer = Trainer(holding_initial_state, optax.sgd(0.1), loss_fn=gpt.loss_fn,
                      strategy=DataParallel(8), metrics=tasks.Metrics)  # fmt: skip
    assert trainer.evaluate([PACKED])["accuracy"] == pytest.approx(want, abs=1e-6)
    chunked = functools.partial(gpt.chunked_loss_fn, chunk_size=4)
    got = nnx.jit(lambda m, b: chunked(m, b)[1]["accuracy"])(model, PACKED)
    assert float(got) == pytest.approx(want, abs=1e-6)


def test_dropping_the_segment_ids_lets_documents_see_each_other(reference):
    losses, _ = reference
    model = built(holding_initial_state)
    leaky = nnx.jit(functools.partial(token_losses, segment_ids=None))(model, PACKED)
    gap = np.abs(trained_losses(leaky, PACKED) - losses)
    # Each row's first document sees nothing before it either way; every later one leaks.
    assert gap.max() > 1e-2
    first = np.asarray(PACKED["segment_ids"] == 1)[np.asarray(gpt.target_weights(PACKED))]
    assert gap[first].max() < 1e-5 and gap[~first].min() > 1e-4


def test_gpt2_hf_takes_segments_and_positions():
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4)
    model = built(lambda r: GPT2(config, rngs=r))
    model.eval()
    packed = nnx.jit(token_losses)(model, PACKED)
    alone = nnx.jit(token_losses)(model, UNPACKED)  # one piece per row
    np.testing.assert_allclose(
        trained_losses(packed, PACKED), trained_losses(alone, UNPACKED), atol=1e-5
    )
    leaky = nnx.jit(functools.partial(token_losses, segment_ids=None))(model, PACKED)
    assert np.abs(trained_losses(leaky, PACKED) - trained_losses(alone, UNPACKED)).max() > 1e-2


# -- the attention alone: padding is finite, the ring skips blocks no segment spans --------
def reference_segment_attention(q, k, v, segments):
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    t = q.shape[1]
    keep = np.tril(np.ones((t, t), bool)) & (
        segments[:, None, :, None] == segments[:, None, None, :]
    )
    scores = np.where(keep, scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("bhqk,bkhd->bqhd", weights / weights.sum(-1, keepdims=True), v)


def test_segment_attention_in_every_form_and_padding_is_finite():
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(2, SEQ, 2, 8)).astype(np.float32) for _ in range(3))
    segments = np.asarray(PACKED["segment_ids"][:2])  # padding at the end of row 1
    want = reference_segment_attention(q, k, v, segments)
    plain = causal_attention(q, k, v, segment_ids=segments)
    np.testing.assert_allclose(np.asarray(plain), want, atol=1e-5)
    assert np.isfinite(np.asarray(plain)).all()

    strategy = Hybrid(DataParallel(2), SequenceParallel(4))
    mesh = strategy.make_mesh()
    split = NamedSharding(mesh, P("data", "seq"))

    def loss(attend):
        return lambda q, k, v: (attend(q, k, v) * np.cos(np.arange(8))).sum()

    def ring(q, k, v):
        return ring_attention(q, k, v, "seq", segment_ids=segments)

    def gathered(q, k, v):
        with strategy.trace_context(mesh):
            return causal_attention(q, k, v, segment_ids=segments)

    expected = jax.grad(loss(lambda *a: causal_attention(*a, segment_ids=segments)), (0, 1, 2))(
        q, k, v
    )
    with jax.set_mesh(mesh):
        args = [jax.device_put(x, split) for x in (q, k, v)]
        for attend in (ring, gathered):
            np.testing.assert_allclose(np.asarray(jax.jit(attend)(*args)), want, atol=1e-5)
            grads = jax.jit(jax.grad(loss(attend), argnums=(0, 1, 2)))(*args)
            for got, e in zip(grads, expected, strict=True):
                np.testing.assert_allclose(np.asarray(got), np.asarray(e), atol=1e-5)


def test_ring_skips_the_blocks_two_documents_never_share():
    # One row of 32 tokens over a ring of 4: 8 half-chunks of 4 tokens, 4 x 4 x 4 = 64 blocks.
    one = np.ones((1, 32), np.int32)
    two = np.repeat([[1, 2]], 16, axis=1)  # documents of 16 tokens: half-chunks 0-3 and 4-7
    causal_only = (ring_schedule(one, 4) == SKIP).sum()
    assert causal_only == 64 - 36  # 2n + 1 = 9 blocks per device are at or below the diagonal
    # Below the diagonal, the 4 x 4 blocks of the second document's queries against the
    # first's keys meet no shared segment: skipped too.
    assert (ring_schedule(two, 4) == SKIP).sum() == causal_only + 16
    # A third document of padding-only chunks changes nothing for the first two's blocks,
    # and padding (segment 0, renumbered last) meets only itself.
    padded = np.concatenate([np.ones((1, 24), np.int32), np.zeros((1, 8), np.int32)], axis=1)
    assert (ring_schedule(padded, 4) == SKIP).sum() == causal_only + 6 * 2


@pytest.mark.skipif(not HAS_GPU, reason="no GPU on this machine")
def test_cudnn_attention_with_segments_agrees_with_xla():
    on_gpu(
        """
import jax, jax.numpy as jnp, numpy as np
from nnx_spmd_trainer.nn.attention import attention_implementation, causal_attention
q, k, v = (jax.random.normal(jax.random.key(i), (2, 128, 4, 32), jnp.bfloat16) for i in range(3))
segments = np.repeat(np.array([[1, 2, 3, 0], [1, 1, 2, 2]], np.int32), 32, axis=1)
assert attention_implementation(jnp.bfloat16) == "cudnn"
fused = jax.jit(lambda q, k, v: causal_attention(q, k, v, segment_ids=segments))
assert "cudnn" in fused.lower(q, k, v).compile().as_text().lower()
reference = causal_attention(*(x.astype(jnp.float32) for x in (q, k, v)), segment_ids=segments)
out = fused(q, k, v).astype(jnp.float32)
assert bool(jnp.isfinite(out).all())
error = float(jnp.abs(out - reference).max())
assert error < 3e-2, error
"""
    )
