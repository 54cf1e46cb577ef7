"""Losses that never hold a whole ``[batch, seq, vocab]`` logits array.

A language model's output projection and softmax cross entropy, computed a
chunk of sequence positions at a time (``chunked_cross_entropy``). With a
large vocabulary the fp32 logits and their gradient dominate a train step's
temporary memory (GPT-2's 50304 tokens x 1024 positions is 206 MB per
sequence, each); here only one chunk's exist at once, forward and backward,
for the cost of computing each chunk's logits twice (``jax.checkpoint``).

Neither optax (0.2.8) nor Flax (0.12.8) ships a chunked or fused
projection + cross entropy; each chunk's loss is optax's own
``softmax_cross_entropy_with_integer_labels``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

__all__ = ["chunked_cross_entropy"]


def _check_shapes(
    features: jax.Array, kernel: jax.Array, bias: jax.Array | None, labels: jax.Array
) -> None:
    """A ValueError naming the shapes that disagree (before tracing the scan)."""
    shapes = f"features {features.shape}, kernel {kernel.shape}, labels {labels.shape}" + (
        "" if bias is None else f", bias {bias.shape}"
    )
    if features.ndim != 3 or kernel.ndim != 2 or labels.shape != features.shape[:2]:
        raise ValueError(
            "chunked_cross_entropy wants features [batch, seq, width], kernel [width, vocab] "
            f"and labels [batch, seq]; got {shapes}."
        )
    if kernel.shape[0] != features.shape[-1] or (
        bias is not None and bias.shape != kernel.shape[1:]
    ):
        raise ValueError(
            f"chunked_cross_entropy: the head does not match the features' width: {shapes}."
        )


def _chunk_count(seq_len: int, chunk_size: int) -> int:
    """How many chunks cover ``seq_len`` positions; a ValueError for a bad ``chunk_size``."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(
            f"chunk_size must be a positive int (positions per chunk), got {chunk_size!r}; "
            f"e.g. 128, or the sequence length {seq_len} for a single chunk."
        )
    return -(-seq_len // chunk_size)


def _chunking(seq_len: int, chunk_size: int) -> tuple[int, int]:
    """(chunks, positions per chunk). A ``chunk_size`` dividing ``seq_len`` is taken as
    given. Otherwise, among the divisors of ``seq_len`` giving chunks of at most
    ``chunk_size`` and at least half as many positions, the one whose chunk
    has the most factors of 2 (then the longest) is taken: no padding, and a
    sequence split evenly over a power-of-two ``seq`` axis stays split in every
    chunk. With no such divisor, ``seq_len`` is padded up to whole chunks."""
    chunks = _chunk_count(seq_len, chunk_size)
    size = min(chunk_size, seq_len)
    if size == 0 or seq_len % size == 0:  # it divides (or there is nothing): as given
        return chunks, size
    fitting = [seq_len // n for n in range(chunks, seq_len + 1) if seq_len % n == 0]
    fitting = [c for c in fitting if 2 * c >= size]
    if not fitting:
        return chunks, size
    best = max(fitting, key=lambda c: ((c & -c), c))  # c & -c: the largest power of 2 in c
    return seq_len // best, best


def _chunk_loss(
    features: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None,
    labels: jax.Array,
    dtype: jnp.dtype | None,
) -> tuple[jax.Array, jax.Array]:
    """Per-token cross entropy and argmax of one chunk ``[batch, chunk]``.

    The projection runs in ``dtype`` as ``nnx.Linear(dtype=...)`` computes it;
    the softmax in fp32. Under a vocabulary split over a mesh axis, XLA
    partitions optax's reductions and label lookup and ``argmax`` per slice:
    what crosses devices is ``[batch, chunk]``-sized, never the logits.
    """
    if dtype is not None:
        features, kernel = features.astype(dtype), kernel.astype(dtype)
        bias = None if bias is None else bias.astype(dtype)
    logits = jnp.einsum("bcd,dv->bcv", features, kernel)
    if bias is not None:
        logits = logits + bias
    logits = logits.astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return losses, jnp.argmax(logits, axis=-1).astype(jnp.int32)


def _into_chunks(x: jax.Array, chunks: int, chunk_size: int) -> jax.Array:
    """``[batch, seq, ...]`` (seq padded to ``chunks * chunk_size``) as
    ``[chunks, batch, chunk_size, ...]``, the scanned axis first.

    Chunk ``j`` holds positions ``j, j + chunks, j + 2 * chunks, ...``: strided, not
    contiguous, so a sequence split over devices (``SequenceParallel``) stays split
    within every chunk and no device gathers the others' positions. Each position's
    loss is its own, so the order does not change a result.
    """
    pad = chunks * chunk_size - x.shape[1]
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape(x.shape[0], chunk_size, chunks, *x.shape[2:])
    return jnp.moveaxis(x, 2, 0)


def _from_chunks(x: jax.Array, seq_len: int) -> jax.Array:
    """The inverse of ``_into_chunks``: ``[batch, seq]`` without the padding."""
    x = jnp.moveaxis(x, 0, 2)
    return x.reshape(x.shape[0], -1)[:, :seq_len]


def chunked_cross_entropy(
    features: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None,
    labels: jax.Array,
    *,
    chunk_size: int,
    dtype: jnp.dtype | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Softmax cross entropy of the projection ``features @ kernel + bias``, a chunk of
    positions at a time, so the ``[batch, seq, vocab]`` logits never exist whole.

    Equal to ``optax.softmax_cross_entropy_with_integer_labels(features @ kernel + bias,
    labels)``, value and gradients (w.r.t. features, kernel and bias). The sequence
    is cut into chunks of ``chunk_size`` positions, visited by ``jax.lax.scan``;
    each chunk's loss is under ``jax.checkpoint``, so the backward pass computes the
    chunk's logits again rather than saving them: the logits (and their gradient)
    held at once are one chunk's, ``[batch, chunk_size, vocab]``, at the price of
    one more head projection per step.

    ``chunk_size`` is the most positions a chunk holds. For a sequence it does not
    divide, a divisor of the sequence length giving chunks of at least half as
    many positions is taken when there is one, preferring a power-of-two chunk (32
    positions with ``chunk_size=5``: 8 chunks of 4); otherwise the sequence is
    padded at the end up to whole chunks (at most ``chunk_size - 1`` wasted
    positions; a padded sequence split over a ``seq`` axis is moved between
    devices) and the padding dropped from the results. A ``chunk_size`` of the
    sequence length or more is one chunk.

    Sharding follows the inputs: rows split over data/FSDP axes stay split, and a
    kernel whose vocabulary is split over a ``model`` axis keeps its logits split
    (XLA reduces each device's slice: what crosses devices is
    ``[rows, positions]``-sized, never the logits). A chunk takes every
    ``chunks``-th position rather than a contiguous run, so a sequence split over a
    ``seq`` axis (``SequenceParallel``) stays split in every chunk when the
    positions per chunk are a multiple of the axis size.

    Args:
      features: ``[batch, seq, width]``, the final hidden states.
      kernel: ``[width, vocab]``, the output projection (e.g. ``nnx.Linear.kernel``).
      bias: ``[vocab]``, or ``None`` for a head without one.
      labels: ``[batch, seq]`` integer targets in ``[0, vocab)``.
      chunk_size: the most positions per chunk; a positive int.
      dtype: the projection's compute dtype (``jnp.bfloat16`` as
        ``nnx.Linear(dtype=jnp.bfloat16)``); default: the inputs'. The logits are cast
        to fp32 for the softmax either way.

    Returns:
      ``(losses, predictions)``: per-token cross entropy in nats, fp32 ``[batch, seq]``,
      and each position's argmax token, int32 ``[batch, seq]``, for accuracy without
      the logits (``predictions == labels``).

    Raises:
      ValueError: a ``chunk_size`` that is not a positive int, or shapes that disagree.

    Example:
      >>> features = jnp.ones((2, 10, 8))
      >>> kernel, bias = jnp.ones((8, 32)), jnp.zeros((32,))
      >>> labels = jnp.zeros((2, 10), jnp.int32)
      >>> losses, predictions = chunked_cross_entropy(
      ...     features, kernel, bias, labels, chunk_size=4)
      >>> losses.shape, predictions.dtype
      ((2, 10), dtype('int32'))
      >>> round(float(losses[0, 0]), 4)  # uniform over 32 tokens: log(32)
      3.4657
    """
    _check_shapes(features, kernel, bias, labels)
    seq_len = labels.shape[1]
    chunks, chunk_size = _chunking(seq_len, chunk_size)

    @jax.checkpoint
    def chunk_loss(x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
        return _chunk_loss(x, kernel, bias, y, dtype)

    def body(
        carry: None, chunk: tuple[jax.Array, jax.Array]
    ) -> tuple[None, tuple[jax.Array, jax.Array]]:
        return carry, chunk_loss(*chunk)

    xs = (
        _into_chunks(features, chunks, chunk_size),
        _into_chunks(labels.astype(jnp.int32), chunks, chunk_size),
    )
    _, (losses, predictions) = jax.lax.scan(body, None, xs)
    return _from_chunks(losses, seq_len), _from_chunks(predictions, seq_len).astype(jnp.int32)
