"""The one per-token log-probability: the output projection and the log-softmax of each
target, a chunk of positions at a time, so ``[rows, seq, vocab]`` never exists.

``token_log_probs(hidden, head_kernel, targets)`` is ``log_softmax(hidden @ kernel +
bias)[target]`` (float32, ``[rows, seq]``), value and gradients, with the logits
(and their gradient) of one chunk, ``[rows, chunk_size, vocab]``, alive at once: the
sequence is cut into chunks visited by ``jax.lax.scan``, each under ``jax.checkpoint``,
so the backward pass computes a chunk's logits again rather than keeping them (one more
head projection per step). SFT's cross entropy (``nn.losses.chunked_cross_entropy``:
the negative of this), DPO, GRPO, the sampler's teacher-forced scoring and lm-eval's
``loglikelihood`` all read it.

The distribution a token is scored under may be a sampler's: the logits divided by
``temperature`` and, where sampling kept only some tokens (top-k, top-p), renormalized
over those whose tempered logit is at least ``kept_min_logit`` (one value per token):
``z_t / T - logsumexp_{z / T >= kept}(z / T)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["DEFAULT_CHUNK_SIZE", "scores_from_logits", "token_log_probs", "token_scores"]

#: Positions per chunk when none is given: 16 rows x 128 positions of a 151,936-id
#: vocabulary are 1.2 GB of float32 logits before any split over devices.
DEFAULT_CHUNK_SIZE = 128


def check_head(
    name: str,
    hidden: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None,
    targets: jax.Array,
) -> None:
    """A ValueError naming the shapes that disagree (before tracing the scan)."""
    shapes = f"hidden {hidden.shape}, kernel {kernel.shape}, targets {targets.shape}" + (
        "" if bias is None else f", bias {bias.shape}"
    )
    if hidden.ndim != 3 or kernel.ndim != 2 or targets.shape != hidden.shape[:2]:
        raise ValueError(
            f"{name} wants hidden states [rows, seq, width], a kernel [width, vocab] "
            f"and targets [rows, seq]; got {shapes}."
        )
    if kernel.shape[0] != hidden.shape[-1] or (bias is not None and bias.shape != kernel.shape[1:]):
        raise ValueError(f"{name}: the head does not match the hidden states' width: {shapes}.")


def _chunk_count(seq_len: int, chunk_size: int) -> int:
    """How many chunks cover ``seq_len`` positions; a ValueError for a bad ``chunk_size``."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(
            f"chunk_size must be a positive int (positions per chunk), got {chunk_size!r}; "
            f"e.g. 128, or the sequence length {seq_len} for a single chunk."
        )
    return -(-seq_len // chunk_size)


def chunking(seq_len: int, chunk_size: int) -> tuple[int, int]:
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


def _into_chunks(x: jax.Array, chunks: int, chunk_size: int, pad_value: float = 0) -> jax.Array:
    """``[rows, seq, ...]`` (seq padded to ``chunks * chunk_size``) as
    ``[chunks, rows, chunk_size, ...]``, the scanned axis first.

    Chunk ``j`` holds positions ``j, j + chunks, j + 2 * chunks, ...``: strided, not
    contiguous, so a sequence split over devices (``SequenceParallel``) stays split
    within every chunk and no device gathers the others' positions. Each position's
    value is its own, so the order does not change a result.
    """
    pad = chunks * chunk_size - x.shape[1]
    widths = [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)
    x = jnp.pad(x, widths, constant_values=pad_value)
    x = x.reshape(x.shape[0], chunk_size, chunks, *x.shape[2:])
    return jnp.moveaxis(x, 2, 0)


def _from_chunks(x: jax.Array, seq_len: int) -> jax.Array:
    """The inverse of ``_into_chunks``: ``[rows, seq]`` without the padding."""
    x = jnp.moveaxis(x, 0, 2)
    return x.reshape(x.shape[0], -1)[:, :seq_len]


def scores_from_logits(
    logits: jax.Array,
    targets: jax.Array,
    *,
    temperature: float = 1.0,
    kept_min_logit: jax.Array | None = None,
    vocab_size: int | None = None,
    greedy: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """``(log_probs, predictions)`` of logits that exist already (``[..., vocab]``, one
    chunk's, a decode step's, or a model's whole output where it gives no head): each
    target's log-probability (float32, ``[...]``) as ``token_log_probs`` defines it, and
    the argmax of the raw logits (int32); with ``greedy``, whether the target is that
    argmax (bool, a tie counting as greedy), which needs no argmax reduction.

    Under a vocabulary split over a mesh axis XLA partitions the reductions and the
    target's lookup per slice: what crosses devices is ``[...]``-sized.
    """
    logits = logits.astype(jnp.float32)
    if vocab_size is not None and vocab_size < logits.shape[-1]:  # a padded vocabulary
        ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
        logits = jnp.where(ids < vocab_size, logits, -jnp.inf)
    # A gather, as optax's cross entropy reads it: its gradient is a scatter XLA fuses
    # into the softmax's; a compare-and-sum over the vocabulary kept two more
    # [rows, chunk, vocab] buffers alive in a train step (867 against 571 MiB at 151,936
    # ids, 16 x 1024, FSDP(8)). Under a vocabulary split over devices XLA partitions it.
    picked = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    if greedy:  # whether the target is the largest logit: no argmax reduce (one buffer less)
        predictions = picked >= jnp.max(logits, axis=-1)
    else:
        predictions = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if temperature != 1.0:  # the gather reads the projection's own output (no copy kept)
        logits, picked = logits / temperature, picked / temperature
    # Where sampling kept only some tokens, the rest leave the normalizer. The scored token
    # is always kept (a sampled one was): a policy whose logits moved after the rollout
    # (GRPO's later updates) never gets an empty normalizer.
    # (The set is a comparison, with no gradient: stop_gradient keeps the backward pass
    # from tracing the gather through it.)
    kept = (
        None
        if kept_min_logit is None
        else jnp.minimum(kept_min_logit, jax.lax.stop_gradient(picked))
    )
    kept_logits = logits if kept is None else jnp.where(logits >= kept[..., None], logits, -jnp.inf)
    normalizer = jax.nn.logsumexp(kept_logits, axis=-1)
    return picked - normalizer, predictions


def _chunk_scores(
    hidden: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None,
    targets: jax.Array,
    kept: jax.Array | None,
    *,
    dtype: jnp.dtype | None,
    temperature: float,
    vocab_size: int | None,
    greedy: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """``scores_from_logits`` of one chunk's projection, run in ``dtype`` as
    ``nnx.Linear(dtype=...)`` computes it (the softmax in float32)."""
    if dtype is not None:
        hidden, kernel = hidden.astype(dtype), kernel.astype(dtype)
        bias = None if bias is None else bias.astype(dtype)
    logits = jnp.einsum("bcd,dv->bcv", hidden, kernel)
    if bias is not None:
        logits = logits + bias
    return scores_from_logits(
        logits,
        targets,
        temperature=temperature,
        kept_min_logit=kept,
        vocab_size=vocab_size,
        greedy=greedy,
    )


def token_scores(
    hidden: jax.Array,
    head_kernel: jax.Array,
    targets: jax.Array,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    temperature: float = 1.0,
    kept_min_logit: jax.Array | None = None,
    head_bias: jax.Array | None = None,
    dtype: jnp.dtype | None = None,
    vocab_size: int | None = None,
    greedy: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """``(token_log_probs(...), predictions)``: also each position's argmax token of the
    raw logits, int32 ``[rows, seq]`` (accuracy, or whether a continuation is greedy)
    from the same pass; with ``greedy``, whether each target is that argmax (bool).
    ``token_log_probs`` says what the other arguments are."""
    check_head("token_log_probs", hidden, head_kernel, head_bias, targets)
    if kept_min_logit is not None and kept_min_logit.shape != targets.shape:
        raise ValueError(
            f"token_log_probs: kept_min_logit is one value per token {targets.shape}, "
            f"got {kept_min_logit.shape}."
        )
    if not temperature > 0:
        raise ValueError(
            f"token_log_probs: temperature={temperature} must be > 0 (a greedy "
            "sampler's tokens are scored at temperature 1)."
        )
    seq_len = targets.shape[1]
    chunks, size = chunking(seq_len, chunk_size)
    has_kept = kept_min_logit is not None

    @jax.checkpoint
    def chunk(x: jax.Array, y: jax.Array, *kept: jax.Array) -> tuple[jax.Array, jax.Array]:
        return _chunk_scores(
            x,
            head_kernel,
            head_bias,
            y,
            kept[0] if has_kept else None,
            dtype=dtype,
            temperature=temperature,
            vocab_size=vocab_size,
            greedy=greedy,
        )

    def body(carry: None, xs: tuple[jax.Array, ...]) -> tuple[None, tuple[jax.Array, jax.Array]]:
        return carry, chunk(*xs)

    xs = [
        _into_chunks(hidden, chunks, size),
        _into_chunks(targets.astype(jnp.int32), chunks, size),
    ]
    if kept_min_logit is not None:  # padded positions keep every token: a finite normalizer
        kept = kept_min_logit.astype(jnp.float32)
        xs.append(_into_chunks(kept, chunks, size, pad_value=-jnp.inf))
    _, (log_probs, predictions) = jax.lax.scan(body, None, tuple(xs))
    predictions = _from_chunks(predictions, seq_len)
    return _from_chunks(log_probs, seq_len), predictions if greedy else predictions.astype(
        jnp.int32
    )


def token_log_probs(
    hidden: jax.Array,
    head_kernel: jax.Array,
    targets: jax.Array,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    temperature: float = 1.0,
    kept_min_logit: jax.Array | None = None,
    head_bias: jax.Array | None = None,
    dtype: jnp.dtype | None = None,
    vocab_size: int | None = None,
) -> jax.Array:
    """Each target's log-probability under the head's logits, float32 ``[rows, seq]``,
    computed ``chunk_size`` positions at a time: ``[rows, seq, vocab]`` never exists,
    forward or backward.

    Equal to ``jax.nn.log_softmax(hidden @ head_kernel + head_bias)`` read at
    ``targets``, value and gradients (w.r.t. ``hidden``, the kernel and the bias).
    Sharding follows the inputs: rows split over data/FSDP axes stay split, and a
    kernel whose vocabulary is split over a ``model`` axis keeps each chunk's logits
    split. A chunk takes every ``chunks``-th position, so a sequence split over a
    ``seq`` axis stays split in every chunk.

    Args:
      hidden: ``[rows, seq, width]``, the final hidden states before the head.
      head_kernel: ``[width, vocab]``, the output projection (``nnx.Linear.kernel``;
        a tied head's embedding transposed).
      targets: ``[rows, seq]`` integer ids in ``[0, vocab)``.
      chunk_size: the most positions per chunk (a divisor of ``seq`` near it is
        preferred; otherwise the end is padded and the padding dropped).
      temperature: the logits are divided by it before the softmax (> 0).
      kept_min_logit: ``[rows, seq]``, the smallest tempered logit a sampler kept at each
        position (top-k / top-p); the softmax is renormalized over the tokens whose
        tempered logit is at least it. ``-inf`` (or ``None``) keeps every token.
      head_bias: ``[vocab]``, or ``None`` for a head without one.
      dtype: the projection's compute dtype (``jnp.bfloat16`` as
        ``nnx.Linear(dtype=jnp.bfloat16)``); default the inputs'. The softmax is fp32.
      vocab_size: the real vocabulary where the kernel's columns are padded past it
        (GPT-2's 50,257 of 50,304): the padding columns are never a token.

    Raises:
      ValueError: shapes that disagree, a bad ``chunk_size`` or ``temperature``.

    Example:
      >>> hidden = jnp.ones((2, 10, 8))
      >>> log_probs = token_log_probs(hidden, jnp.ones((8, 32)), jnp.zeros((2, 10), int),
      ...                             chunk_size=4)
      >>> log_probs.shape, round(float(log_probs[0, 0]), 4)  # uniform: -log(32)
      ((2, 10), -3.4657)
    """
    return token_scores(
        hidden,
        head_kernel,
        targets,
        chunk_size=chunk_size,
        temperature=temperature,
        kept_min_logit=kept_min_logit,
        head_bias=head_bias,
        dtype=dtype,
        vocab_size=vocab_size,
    )[0]
