"""chunked_cross_entropy: the head's cross entropy a chunk of positions at a time.

Checked against optax's cross entropy on the full logits (``features @ kernel +
bias`` written out here), values and gradients, on one device and under
``Hybrid(FSDP(4), TensorParallel(2))``; and its point, the compiled gradient's
temporary memory, against the plain loss's.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_spmd_trainer import (
    FSDP,
    Hybrid,
    SequenceParallel,
    TensorParallel,
    chunked_cross_entropy,
)

BATCH, SEQ, WIDTH, VOCAB = 4, 24, 16, 64


def random_head(batch=BATCH, seq=SEQ, width=WIDTH, vocab=VOCAB, seed=0):
    """Features, kernel, bias and labels with logits of order 1 (a real softmax)."""
    keys = jax.random.split(jax.random.key(seed), 4)
    features = jax.random.normal(keys[0], (batch, seq, width))
    kernel = jax.random.normal(keys[1], (width, vocab)) / np.sqrt(width)
    bias = 0.5 * jax.random.normal(keys[2], (vocab,))
    labels = jax.random.randint(keys[3], (batch, seq), 0, vocab)
    return features, kernel, bias, labels


def full_logits(features, kernel, bias, dtype=None):
    if dtype is not None:
        features, kernel, bias = (x.astype(dtype) for x in (features, kernel, bias))
    return (features @ kernel + bias).astype(jnp.float32)


def plain_loss(features, kernel, bias, labels, dtype=None):
    logits = full_logits(features, kernel, bias, dtype)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def chunked_loss(features, kernel, bias, labels, chunk_size, dtype=None):
    """The mean loss, with the per-token losses and predictions as aux."""
    losses, predictions = chunked_cross_entropy(
        features, kernel, bias, labels, chunk_size=chunk_size, dtype=dtype
    )
    return losses.mean(), (losses, predictions)


def value_and_grads(loss, *args, has_aux=False, **static):
    """The loss and its gradients w.r.t. features, kernel and bias, jitted."""
    grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=has_aux)
    return jax.jit(grad, static_argnames=tuple(static))(*args, **static)


def assert_close(actual, expected, tol):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=tol, atol=tol)


@pytest.mark.parametrize("chunk_size", [5, SEQ, 100])
def test_equals_optax_on_the_full_logits(chunk_size):
    """Per-token losses, their mean's gradients (fp32, 1e-5) and the predictions (the
    argmax): chunks not dividing the sequence (5: padded), the whole sequence (24)
    and more than it (100: one chunk); chunks dividing it in the sharded tests."""
    features, kernel, bias, labels = random_head()
    (value, (per_token, predictions)), grads = value_and_grads(
        chunked_loss, features, kernel, bias, labels, has_aux=True, chunk_size=chunk_size
    )
    logits = full_logits(features, kernel, bias)
    expected = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    assert per_token.shape == (BATCH, SEQ) and per_token.dtype == jnp.float32
    assert_close(per_token, expected, 1e-5)
    assert_close((value, grads), value_and_grads(plain_loss, features, kernel, bias, labels), 1e-5)
    assert predictions.dtype == jnp.int32
    np.testing.assert_array_equal(predictions, jnp.argmax(logits, -1))


def test_a_head_without_bias():
    features, kernel, bias, labels = random_head(seed=2)
    no_bias = jnp.zeros_like(bias)
    losses, _ = chunked_cross_entropy(features, kernel, None, labels, chunk_size=8)
    expected = optax.softmax_cross_entropy_with_integer_labels(
        full_logits(features, kernel, no_bias), labels
    )
    assert_close(losses, expected, 1e-5)


def test_bf16_is_close_to_the_plain_bf16_projection():
    """dtype=bf16 computes the projection as nnx.Linear(dtype=bf16) does (a bf16 matmul),
    close to the plain bf16 computation (to bf16 rounding); losses in fp32."""
    features, kernel, bias, labels = random_head(seed=3)
    jaxpr = jax.make_jaxpr(
        lambda *args: chunked_cross_entropy(*args, chunk_size=8, dtype=jnp.bfloat16)
    )(features, kernel, bias, labels)
    assert re.search(r"bf16\[[\d,]+\] = dot_general", str(jaxpr)), "no bf16 projection"
    (value, (losses, _)), grads = value_and_grads(
        chunked_loss, features, kernel, bias, labels,
        has_aux=True, chunk_size=8, dtype=jnp.bfloat16,
    )  # fmt: skip
    assert losses.dtype == jnp.float32
    expected = optax.softmax_cross_entropy_with_integer_labels(
        full_logits(features, kernel, bias, jnp.bfloat16), labels
    )
    assert_close(losses, expected, 2e-2)
    plain = value_and_grads(plain_loss, features, kernel, bias, labels, dtype=jnp.bfloat16)
    assert_close((value, grads), plain, 2e-2)


@pytest.mark.parametrize("chunk_size", [0, -4, 2.5, True, None])
def test_a_bad_chunk_size_is_a_clear_error(chunk_size):
    features, kernel, bias, labels = random_head()
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        chunked_cross_entropy(features, kernel, bias, labels, chunk_size=chunk_size)


def test_shapes_that_disagree_are_a_clear_error():
    features, kernel, bias, labels = random_head()
    with pytest.raises(ValueError, match="does not match the features' width"):
        chunked_cross_entropy(features, kernel.T, bias, labels, chunk_size=8)
    with pytest.raises(ValueError, match="labels \\[batch, seq\\]"):
        chunked_cross_entropy(features, kernel, bias, labels[:, :-1], chunk_size=8)


def sharded_step(mesh, specs, head, chunk_size=4):
    """The jitted loss, predictions and gradients on ``head`` placed by ``specs``, and
    the compiled step's HLO text."""
    placed = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(head, specs, strict=True)]

    def loss(features, kernel, bias, labels):
        losses, predictions = chunked_cross_entropy(
            features, kernel, bias, labels, chunk_size=chunk_size
        )
        return losses.mean(), predictions

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    with jax.set_mesh(mesh):
        compiled = step.lower(*placed).compile()
        (value, predictions), grads = compiled(*placed)
    return value, predictions, grads, compiled.as_text()


def assert_equals_one_device(head, value, predictions, grads):
    expected_value, expected_grads = value_and_grads(plain_loss, *head)
    assert_close((value, grads), (expected_value, expected_grads), 1e-5)
    np.testing.assert_array_equal(predictions, jnp.argmax(full_logits(*head[:3]), -1))


COLLECTIVE = r"= \(?(\w+)\[([\d,]*)\]\S* (all-gather|all-reduce|all-to-all|reduce-scatter)\("


def test_sharded_under_fsdp_and_tensor_parallel():
    """Rows over fsdp (4), the vocabulary over model (2): the same values and gradients
    as one device, gradients laid out as their inputs, and no collective in the
    compiled step as large as a chunk's logits (the vocabulary is never gathered)."""
    mesh = Hybrid(FSDP(4), TensorParallel(2)).make_mesh()
    head = random_head(batch=8, seq=16, vocab=128, seed=4)
    specs = (P("fsdp"), P(None, "model"), P("model"), P("fsdp"))
    value, predictions, grads, hlo = sharded_step(mesh, specs, head)
    assert_equals_one_device(head, value, predictions, grads)
    assert [g.sharding.spec for g in grads] == list(specs[:3])
    # What crosses devices is [rows, positions]-sized (the partial maxima, sums and
    # argmaxes), never an array with a vocabulary dimension (64 per device, 128 whole).
    shapes = [[int(d) for d in m[2].split(",") if d] for m in re.finditer(COLLECTIVE, hlo)]
    assert shapes, "no collective found: the pattern no longer matches XLA's HLO text"
    assert not [s for s in shapes if len(s) >= 3 and {64, 128} & set(s)], shapes


def test_sharded_under_fsdp_and_sequence_parallel():
    """Rows over fsdp (2), the sequence over seq (4): equal to one device, and no
    all-gather at all: the strided chunks keep each device's positions its own."""
    mesh = Hybrid(FSDP(2), SequenceParallel(4)).make_mesh()
    head = random_head(batch=4, seq=32, seed=5)
    specs = (P("fsdp", "seq"), P(), P(), P("fsdp", "seq"))
    value, predictions, grads, hlo = sharded_step(mesh, specs, head)
    assert_equals_one_device(head, value, predictions, grads)
    assert grads[0].sharding.spec == specs[0]
    assert re.search(COLLECTIVE, hlo), "no collective found: the pattern no longer matches"
    assert "all-gather" not in hlo


@pytest.mark.parametrize(("seq", "chunk_size"), [(32, 5), (36, 8)])
def test_a_chunk_size_that_does_not_divide_a_split_sequence_keeps_the_split(seq, chunk_size):
    """32 positions with chunk_size 5 go in 8 chunks of 4, and 36 with 8 in 9 of 4 (no
    padding, which the seq axis could not split evenly): exact, nothing all-gathered,
    and the features' gradient still split over seq."""
    mesh = Hybrid(FSDP(2), SequenceParallel(4)).make_mesh()
    head = random_head(batch=4, seq=seq, seed=6)
    specs = (P("fsdp", "seq"), P(), P(), P("fsdp", "seq"))
    value, predictions, grads, hlo = sharded_step(mesh, specs, head, chunk_size=chunk_size)
    assert_equals_one_device(head, value, predictions, grads)
    assert grads[0].sharding.spec == specs[0]
    assert "all-gather" not in hlo


@pytest.mark.parametrize(
    ("seq", "chunk_size", "chunks"),
    [(96, 48, 2), (24, 8, 3), (32, 5, 8), (36, 8, 9), (23, 5, 5), (24, 100, 1), (1, 1, 1)],
)
def test_how_many_chunks_the_scan_visits(seq, chunk_size, chunks):
    """A dividing chunk_size as given; else a divisor with chunks of at least half of it
    (power-of-two chunks first); else padding up to whole chunks."""
    head = random_head(seq=seq, seed=8)
    jaxpr = jax.make_jaxpr(lambda *a: chunked_cross_entropy(*a, chunk_size=chunk_size))(*head)
    (scan,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert scan.params["length"] == chunks


@pytest.mark.parametrize("seq", [23, 31])
def test_a_sequence_with_no_fitting_divisor_is_padded_and_exact(seq):
    """23 and 31 positions (primes) in chunks of 5: padded to whole chunks, padding dropped."""
    head = random_head(seq=seq, seed=7)
    (value, (losses, _)), grads = value_and_grads(chunked_loss, *head, has_aux=True, chunk_size=5)
    assert losses.shape == (BATCH, seq)
    expected_value, expected_grads = value_and_grads(plain_loss, *head)
    assert_close((value, grads), (expected_value, expected_grads), 1e-5)


def temp_bytes(loss, chunk_size=None):
    """The compiled gradient step's temporary bytes at a GPT-2 vocabulary, one device."""
    batch, seq, width, vocab = 2, 512, 64, 50304
    shapes = [
        jax.ShapeDtypeStruct((batch, seq, width), jnp.float32),
        jax.ShapeDtypeStruct((width, vocab), jnp.float32),
        jax.ShapeDtypeStruct((vocab,), jnp.float32),
        jax.ShapeDtypeStruct((batch, seq), jnp.int32),
    ]
    static = {} if chunk_size is None else {"chunk_size": chunk_size}
    grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=chunk_size is not None)
    step = jax.jit(grad, static_argnames=tuple(static))
    return step.lower(*shapes, **static).compile().memory_analysis().temp_size_in_bytes


def test_temporary_memory_is_a_fraction_of_the_plain_loss():
    """Vocabulary 50304, 2 x 512 positions, chunks of 64: the plain loss holds the whole
    [2, 512, 50304] fp32 logits and their gradient (196 MiB each); the chunked one a
    chunk's. Measured here: 62 MiB vs 393 MiB (0.16x); asserted < 0.4x."""
    plain, chunked = temp_bytes(plain_loss), temp_bytes(chunked_loss, chunk_size=64)
    print(f"temp bytes: chunked {chunked / 2**20:.1f} MiB, plain {plain / 2**20:.1f} MiB, "
          f"ratio {chunked / plain:.3f}")  # fmt: skip
    assert chunked < 0.4 * plain
