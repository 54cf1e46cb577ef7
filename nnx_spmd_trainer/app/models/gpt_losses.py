"""The GPT's losses: next-token cross entropy over the whole logits (``loss_fn``) or a
chunk of positions at a time (``chunked_loss_fn``), each over the real rows of a padded
batch and the trained targets of a packed one (``nn.packed.target_weights``).

``loss_fn`` asks only ``model(inputs, **packed_inputs(batch))`` of a model, so GPT-2
(``gpt2_hf``) trains with it too; ``chunked_loss_fn`` also reads the hidden states before
the head and the head (``GPT.features``, ``GPT.head``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from nnx_spmd_trainer.nn.losses import chunked_cross_entropy
from nnx_spmd_trainer.nn.moe import moe_losses
from nnx_spmd_trainer.nn.packed import packed_inputs, target_weights
from nnx_spmd_trainer.planner.step import masked_mean

__all__ = ["chunked_loss_fn", "loss_fn"]


@runtime_checkable
class _Headed(Protocol):
    """What ``chunked_loss_fn`` reads of a model (``GPT`` has both)."""

    head: nnx.Linear

    def features(
        self,
        tokens: jax.Array,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
    ) -> jax.Array: ...


def _token_mean(losses: jax.Array, batch: Mapping[str, jax.Array]) -> jax.Array:
    """``masked_mean`` over real rows; over a packed batch, the mean over its trained targets."""
    weights = target_weights(batch)
    if weights is None:
        return masked_mean(losses, batch)
    return masked_mean(jnp.where(weights, losses, 0.0), batch) / jnp.maximum(
        masked_mean(weights.astype(jnp.float32), batch), 1e-9
    )


def _token_accuracy(correct: jax.Array, batch: Mapping[str, jax.Array]) -> jax.Array:
    """Each token's correctness ``[batch, seq]``; over a packed batch, its mean over the
    trained targets (a scalar, counted once per row as the loss is): its padding and the
    targets across a document boundary are not predictions the loss asks for."""
    if target_weights(batch) is None:
        return correct
    return _token_mean(correct.astype(jnp.float32), batch)


def loss_fn(
    model: nnx.Module, batch: dict[str, jax.Array]
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean next-token cross entropy (nats) of ``batch["targets"]`` given ``batch["inputs"]``,
    over the real sequences (a padded batch's ``mask``); over a packed batch
    (``segment_ids``, ``positions``), the mean over its targets within a document
    (``target_weights``).

    ``aux`` holds each token's correctness, averaged per token by the metrics; over a
    packed batch, the batch's mean accuracy over its trained targets, a scalar the
    metrics count once per row as they count the loss (``_token_accuracy``). A model with
    MoE blocks adds their auxiliary losses and reports their metrics (``moe.moe_losses``).
    """
    logits = model(batch["inputs"], **packed_inputs(batch)).astype(jnp.float32)
    targets = batch["targets"]
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    extra, moe_aux = moe_losses(model)
    return _token_mean(losses, batch) + extra, {
        "accuracy": _token_accuracy(jnp.argmax(logits, axis=-1) == targets, batch),
        **moe_aux,
    }


def chunked_loss_fn(
    model: nnx.Module, batch: dict[str, jax.Array], *, chunk_size: int
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``loss_fn`` with the head's projection and the cross entropy computed ``chunk_size``
    sequence positions at a time (``losses.chunked_cross_entropy``): the
    ``(batch, seq, vocab)`` logits never exist whole, forward or backward.

    The same loss and per-token accuracy as ``loss_fn`` (to float rounding), for one
    more head projection per step (the backward pass recomputes each chunk's logits).
    The projection runs in the head's compute dtype, as ``nnx.Linear`` runs it. The
    model must offer ``features`` (the hidden states before the head) and ``head`` (an
    ``nnx.Linear``), as ``GPT`` does.
    """
    if not isinstance(model, _Headed):
        raise TypeError(
            f"chunked_loss_fn reads model.features(tokens, ...) and model.head (an nnx.Linear), "
            f"as GPT has them; {type(model).__name__} lacks them. Use loss_fn "
            "(in the CLI: --config.gpt.chunked_loss=0)."
        )
    head = model.head
    targets = batch["targets"]
    losses, predictions = chunked_cross_entropy(
        model.features(batch["inputs"], **packed_inputs(batch)),
        head.kernel[...],
        None if head.bias is None else head.bias[...],
        targets,
        chunk_size=chunk_size,
        dtype=None if head.dtype is None else jnp.dtype(head.dtype),
    )
    extra, moe_aux = moe_losses(model)
    return _token_mean(losses, batch) + extra, {
        "accuracy": _token_accuracy(predictions == targets, batch),
        **moe_aux,
    }
