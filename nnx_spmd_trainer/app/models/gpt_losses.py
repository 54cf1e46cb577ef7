"""The GPT's losses: next-token cross entropy over the whole logits (``loss_fn``) or a
chunk of positions at a time (``chunked_loss_fn``), each over the real rows of a padded
batch and the trained targets of a packed or weighted one (``nn.packed.token_weights``:
``target_weights`` times the batch's ``loss_weights``). Over such targets they report
their total weight as ``aux[TOKEN_WEIGHT]``, so gradient accumulation gives the mean
over the whole batch's trained tokens (``planner.step.compute_gradients``).

``loss_fn`` asks only ``model(inputs, **packed_inputs(batch))`` of a model;
``chunked_loss_fn`` also reads the hidden states before the head and the head
(``GPT.features`` and ``GPT.head``; ``GPT2.features`` and ``GPT2.output_head()``).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from nnx_spmd_trainer import (
    TOKEN_WEIGHT,
    OutputHead,
    batch_mask,
    chunked_cross_entropy,
    masked_mean,
)
from nnx_spmd_trainer import moe as moe_lib
from nnx_spmd_trainer.nn import PACKING_FIELDS, packed_inputs, packing_fields, token_weights

__all__ = ["chunked_loss_fn", "loss_fn"]


def _head(model: nnx.Module) -> OutputHead | None:
    """What ``chunked_loss_fn`` projects: ``model.output_head()`` (GPT-2's tied head) or
    ``model.head`` (an ``nnx.Linear``: GPT's), beside ``model.features``; else ``None``."""
    if not callable(getattr(model, "features", None)):
        return None
    if callable(getattr(model, "output_head", None)):
        return model.output_head()  # type: ignore[attr-defined,no-any-return]
    head = getattr(model, "head", None)
    if not isinstance(head, nnx.Linear):
        return None
    return OutputHead(
        head.kernel[...],
        None if head.bias is None else head.bias[...],
        None if head.dtype is None else jnp.dtype(head.dtype),
    )


def _checked(batch: Mapping[str, jax.Array], name: str) -> None:
    """A ValueError naming the batch's keys when it lacks ``inputs``/``targets`` or carries
    packing fields these losses do not read (Grain's ``*_segment_ids``: they would train
    the rows as if unpacked)."""
    keys = sorted(map(str, dict.keys(batch) if isinstance(batch, dict) else batch))
    missing = [key for key in ("inputs", "targets") if key not in batch]
    foreign = [key for key in packing_fields(keys) if key not in PACKING_FIELDS]
    if not missing and not foreign:
        return
    grain = (
        " Rows packed by Grain become this batch through "
        "nnx_spmd_trainer.data.from_grain_packed (docs/topics/packing.md)."
    )
    if missing:
        raise ValueError(
            f"{name} needs the batch keys ['inputs', 'targets'] (and, packed, "
            f"{list(PACKING_FIELDS)}); this batch lacks {missing}: it has {keys}."
            f"{grain if foreign else ''}"
        )
    raise ValueError(
        f"{name} does not read the batch's fields {foreign}: trained so, the rows would "
        f"count as unpacked. It reads {list(PACKING_FIELDS)}.{grain}"
    )


def _token_mean(
    losses: jax.Array, batch: Mapping[str, jax.Array]
) -> tuple[jax.Array, jax.Array | None]:
    """``(mean, None)``: ``masked_mean`` over real rows; over a packed or weighted batch,
    ``(mean, weight)``: the weighted mean over its trained targets and their total weight."""
    weights = token_weights(batch)
    if weights is None:
        return masked_mean(losses, batch), None
    rows = batch_mask(batch).astype(bool)[:, None]
    weights = jnp.where(rows, weights, 0.0)
    total = weights.sum(dtype=jnp.float32)
    weighted = jnp.where(weights != 0, losses * weights, 0.0).sum(dtype=jnp.float32)
    return weighted / jnp.maximum(total, 1e-9), total


def _token_accuracy(correct: jax.Array, batch: Mapping[str, jax.Array]) -> jax.Array:
    """Each token's correctness ``[batch, seq]``; over a packed or weighted batch, its mean
    over the trained targets (a scalar, counted once per row as the loss is): its padding
    and the targets across a document boundary are not predictions the loss asks for."""
    if token_weights(batch) is None:
        return correct
    return _token_mean(correct.astype(jnp.float32), batch)[0]


def _with_weight(aux: dict[str, jax.Array], weight: jax.Array | None) -> dict[str, jax.Array]:
    """``aux`` with the trained tokens' total weight (``TOKEN_WEIGHT``) when there is one."""
    return aux if weight is None else {**aux, TOKEN_WEIGHT: weight}


def loss_fn(
    model: nnx.Module, batch: dict[str, jax.Array]
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean next-token cross entropy (nats) of ``batch["targets"]`` given ``batch["inputs"]``,
    over the real sequences (a padded batch's ``mask``); over a packed batch
    (``segment_ids``, ``positions``), the mean over its targets within a document
    (``target_weights``), each weighted by ``batch["loss_weights"]`` when the batch
    has it (``token_weights``). Over such targets ``aux[TOKEN_WEIGHT]`` holds their
    total weight: gradient accumulation then gives the batch's token mean.

    ``aux`` holds each token's correctness, averaged per token by the metrics; over a
    packed batch, the batch's mean accuracy over its trained targets, a scalar the
    metrics count once per row as they count the loss (``_token_accuracy``). A model with
    MoE blocks adds their auxiliary losses and reports their metrics (``moe.moe_losses``).
    """
    _checked(batch, "gpt.loss_fn")
    logits = model(batch["inputs"], **packed_inputs(batch)).astype(jnp.float32)
    targets = batch["targets"]
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    extra, moe_aux = moe_lib.moe_losses(model)
    mean, weight = _token_mean(losses, batch)
    aux = {"accuracy": _token_accuracy(jnp.argmax(logits, axis=-1) == targets, batch), **moe_aux}
    return mean + extra, _with_weight(aux, weight)


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
    ``nnx.Linear``, as ``GPT`` does) or ``output_head()`` (GPT-2's tied head over its
    padded vocabulary).
    """
    head = _head(model)
    if head is None:
        raise TypeError(
            f"chunked_loss_fn reads model.features(tokens, ...) and model.head (an nnx.Linear) "
            f"or model.output_head(), as GPT and GPT-2 have them; {type(model).__name__} "
            "lacks them. Use loss_fn (in the CLI: --config.gpt.chunked_loss=0)."
        )
    _checked(batch, "gpt.chunked_loss_fn")
    targets = batch["targets"]
    losses, predictions = chunked_cross_entropy(
        model.features(batch["inputs"], **packed_inputs(batch)),  # type: ignore[attr-defined]
        head.kernel,
        head.bias,
        targets,
        chunk_size=chunk_size,
        dtype=head.dtype,
        vocab_size=head.vocab_size,
    )
    extra, moe_aux = moe_lib.moe_losses(model)
    mean, weight = _token_mean(losses, batch)
    aux = {"accuracy": _token_accuracy(predictions == targets, batch), **moe_aux}
    return mean + extra, _with_weight(aux, weight)
