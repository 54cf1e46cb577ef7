"""Losses that never hold a whole ``[batch, seq, vocab]`` logits array.

A language model's output projection and softmax cross entropy, computed a
chunk of sequence positions at a time (``chunked_cross_entropy``). With a
large vocabulary the fp32 logits and their gradient dominate a train step's
temporary memory (GPT-2's 50304 tokens x 1024 positions is 206 MB per
sequence, each); here only one chunk's exist at once, forward and backward,
for the cost of computing each chunk's logits twice (``jax.checkpoint``).

Neither optax (0.2.8) nor Flax (0.12.8) ships a chunked or fused
projection + cross entropy. The loss is the negative of the one per-token
log-probability (``nn.logprob.token_scores``): one scan, one chunking, for SFT
and post-training alike.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nnx_spmd_trainer.nn.logprob import token_scores

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


def chunked_cross_entropy(
    features: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None,
    labels: jax.Array,
    *,
    chunk_size: int,
    dtype: jnp.dtype | None = None,
    vocab_size: int | None = None,
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
      vocab_size: the real vocabulary where the kernel's columns are padded past it
        (GPT-2's tied head): the padding columns are never predicted.

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
    log_probs, predictions = token_scores(
        features,
        kernel,
        labels,
        chunk_size=chunk_size,
        head_bias=bias,
        dtype=dtype,
        vocab_size=vocab_size,
    )
    return -log_probs, predictions
