"""A model's per-token log-probabilities through ``nn.logprob.token_scores``: what a
model says of itself so its head can be projected a chunk of positions at a time.

The protocol (the shipped ``GPT`` and ``GPT2`` follow it; a user's model may):

- ``model.features(tokens, segment_ids=None, positions=None) -> [rows, seq, width]``:
  the final hidden states, before the head;
- and either ``model.head``, an ``nnx.Linear`` ``[width, vocab]`` (``GPT``), or
  ``model.output_head() -> OutputHead`` (a tied or padded head: ``GPT2``'s is its token
  embedding, transposed, over a vocabulary padded past ``vocab_size``).

A model without it (or whose head carries LoRA adapters: the adapters' update is the
layer's own to compute) is scored on its full logits, ``model(tokens, ...)``, by the
same formula (``nn.logprob.scores_from_logits``); ``chunk_reason`` says why, and the
post-training trainers put that line in their plan's notes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_spmd_trainer.nn.logprob import DEFAULT_CHUNK_SIZE, scores_from_logits, token_scores

__all__ = ["OutputHead", "chunk_reason", "log_prob_note", "model_token_scores", "output_head"]

#: ``(model, inputs) -> logits [rows, seq, vocab]``: how a model is called on tokens.
LogitsFn = Callable[[nnx.Module, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class OutputHead:
    """A model's output projection, as ``token_log_probs`` reads it.

    Attributes:
      kernel: ``[width, vocab]``.
      bias: ``[vocab]``, or ``None``.
      dtype: the projection's compute dtype (``nnx.Linear.dtype``); ``None``: the inputs'.
      vocab_size: the real vocabulary where ``kernel``'s columns are padded past it.
    """

    kernel: jax.Array
    bias: jax.Array | None = None
    dtype: Any = None
    vocab_size: int | None = None


def _adapted(layer: nnx.Module) -> bool:
    """Whether ``layer`` carries LoRA adapters (an ``nn.lora`` adapted class)."""
    return hasattr(layer, "lora_a") and hasattr(layer, "lora_b")


def output_head(model: nnx.Module) -> OutputHead | None:
    """``model.output_head()``, or its ``head`` when that is a plain ``nnx.Linear``; else
    ``None`` (``chunk_reason`` says why)."""
    if chunk_reason(model) is not None:
        return None
    if callable(getattr(model, "output_head", None)):
        return model.output_head()  # type: ignore[attr-defined,no-any-return]
    head = model.head  # type: ignore[attr-defined]
    return OutputHead(
        head.kernel[...],
        None if head.bias is None else head.bias[...],
        None if head.dtype is None else jnp.dtype(head.dtype),
    )


def chunk_reason(model: nnx.Module) -> str | None:
    """``None`` where ``model`` follows the protocol (its head can be chunked); else
    one line saying what it lacks and what is done instead."""
    name = type(model).__name__
    if not callable(getattr(model, "features", None)):
        lacks = "features(tokens, segment_ids=None, positions=None)"
    elif callable(getattr(model, "output_head", None)):
        return None
    elif not isinstance(getattr(model, "head", None), nnx.Linear):
        lacks = "head (an nnx.Linear) or output_head()"
    elif _adapted(model.head):  # type: ignore[attr-defined]
        return (
            f"{name}'s head carries LoRA adapters: its log-probabilities are read from the "
            "whole [rows, seq, vocab] logits (leave the head out of LoRA's targets to chunk)."
        )
    else:
        return None
    return (
        f"{name} has no {lacks} (nn.logprob_model's protocol): its log-probabilities are "
        "read from the whole [rows, seq, vocab] logits, not a chunk of positions at a time."
    )


def log_prob_note(trainer: str, model: nnx.Module, logits_fn: object | None) -> str | None:
    """Why a post-training trainer reads its models' log-probabilities from the whole
    logits (one line, for its plan report), or ``None`` where they are chunked."""
    if logits_fn is not None:
        return f"{trainer}(logits_fn=...): log-probabilities read from the whole logits."
    return chunk_reason(model)


def model_token_scores(
    model: nnx.Module,
    inputs: jax.Array,
    targets: jax.Array,
    *,
    model_inputs: Mapping[str, jax.Array] | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    temperature: float = 1.0,
    kept_min_logit: jax.Array | None = None,
    logits_fn: LogitsFn | None = None,
    greedy: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """``(log_probs, predictions)``, ``[rows, seq]`` each: ``model``'s log-probability of
    each of ``targets`` given ``inputs`` (float32) and its argmax token (int32).

    Through the protocol, the head is projected ``chunk_size`` positions at a time
    (``nn.logprob.token_scores``); otherwise (``chunk_reason``), or with ``logits_fn``
    given (a user's own call of the model), from the whole logits, by the same formula.

    Args:
      model: the model (in the caller's trace).
      inputs, targets: ``[rows, seq]`` token ids.
      model_inputs: the packed rows' ``segment_ids`` / ``positions``, given to the model.
      chunk_size, temperature, kept_min_logit: as ``nn.token_log_probs``.
      logits_fn: ``(model, inputs) -> logits``: the model's logits are read this way,
        whole (a model called otherwise than ``model(inputs)``).
      greedy: the second output is whether each target is the argmax (bool), computed
        without an argmax reduction (lm-eval's ``is_greedy``).
    """
    extra = dict(model_inputs or {})
    head = None if logits_fn is not None else output_head(model)
    if head is None:
        call = logits_fn or (lambda m, x: m(x, **extra))  # type: ignore[operator]
        logits = call(model, inputs)
        return scores_from_logits(
            logits, targets, temperature=temperature, kept_min_logit=kept_min_logit, greedy=greedy
        )
    hidden = model.features(inputs, **extra)  # type: ignore[attr-defined]
    return token_scores(
        hidden,
        head.kernel,
        targets,
        chunk_size=chunk_size,
        temperature=temperature,
        kept_min_logit=kept_min_logit,
        head_bias=head.bias,
        dtype=head.dtype,
        vocab_size=head.vocab_size,
        greedy=greedy,
    )
