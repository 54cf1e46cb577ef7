"""Packed rows: what a batch of documents packed into rows tells the model and its loss.

A packed batch holds, beside ``inputs`` and ``targets`` (the next token of each
input), ``segment_ids`` (``[rows, seq]``: ``1..k`` for the documents of a row, ``0``
for padding) and ``positions`` (each token's position in its document, restarting
at 0). The attention reads the first (``attention.causal_attention(...,
segment_ids=...)``), the position embedding the second; the loss counts the
targets ``target_weights`` keeps. Any batch, packed or not, may also carry
``loss_weights`` (float ``[rows, seq]``, aligned with ``targets``: the weight of
predicting each target, 0 for one not trained, such as a chat prompt's tokens);
``token_weights`` combines the two. docs/topics/packing.md shows a model of one's own.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

__all__ = [
    "PACKING_FIELDS",
    "packed_inputs",
    "packing_fields",
    "target_weights",
    "token_weights",
]

# The fields of a batch that say how its rows are packed and which targets train: a loss
# that never reads one of them trains the rows as if unpacked (planner.step refuses it).
PACKING_FIELDS = ("segment_ids", "positions", "target_segment_ids", "loss_weights")


def packing_fields(keys: Iterable[Any]) -> list[str]:
    """The keys among ``keys`` that say how rows are packed or which targets train:
    ``PACKING_FIELDS`` and any ``*_segment_ids`` / ``*_positions`` (Grain's names)."""
    return sorted(
        key
        for key in keys
        if isinstance(key, str)
        and (key in PACKING_FIELDS or key.endswith(("_segment_ids", "_positions")))
    )


def packed_inputs(batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """The model's keyword arguments a packed batch carries (``segment_ids``, ``positions``);
    ``{}`` for a batch of one sequence per row."""
    return {name: batch[name] for name in ("segment_ids", "positions") if name in batch}


def target_weights(batch: Mapping[str, jax.Array]) -> jax.Array | None:
    """Which targets a packed batch trains on (``[batch, seq]`` bool), else ``None``.

    A target counts when its input is a document's token (``segment_ids != 0``) and
    the target is in the same segment. The target's segment is
    ``batch["target_segment_ids"]`` when the batch has it: rows of
    ``data.packing`` (``pack_documents``, ``ContiguousRows``) carry it, and there a
    document longer than a row is split into chunks of (input, target) pairs, each
    its own segment, so every target of the document is kept exactly once, the first
    pair of a continued chunk included (predicted from one token of context).

    Without ``target_segment_ids`` (rows a user packs by hand, inputs and targets the
    row of ``seq + 1`` tokens shifted by one), the target's segment is the next
    input's: the target of a document's last token (the next document's first token)
    is left out, and the row's last target is taken to continue its input's document.

    >>> batch = {"segment_ids": jnp.array([[1, 1, 1, 2, 2, 0]])}
    >>> target_weights(batch).astype(int)
    Array([[1, 1, 0, 1, 0, 0]], dtype=int32)
    >>> batch = {"segment_ids": jnp.array([[1, 1]]), "target_segment_ids": jnp.array([[1, 2]])}
    >>> target_weights(batch).astype(int)
    Array([[1, 0]], dtype=int32)

    A document split across such hand-packed rows: its continuation starts the next
    row at position 0 as a segment of its own; its first token is an input there and
    no target (no input of its row precedes it), and its other targets are predicted
    from the continuation alone. So those rows train on exactly the targets that the
    same pieces, one per row, would: the one target lost per split is skipped, not
    predicted from nothing.
    """
    if "segment_ids" not in batch:
        return None
    segments = batch["segment_ids"]
    following = batch.get("target_segment_ids")
    if following is None:
        following = jnp.concatenate([segments[:, 1:], segments[:, -1:]], axis=1)
    return (segments != 0) & (following == segments)


def token_weights(batch: Mapping[str, jax.Array]) -> jax.Array | None:
    """The weight of each target (``[batch, seq]`` float32), else ``None``: the packed
    rule (``target_weights``: 1 for a target within its input's document, 0 otherwise)
    times ``batch["loss_weights"]`` when the batch has it.

    A loss that averages ``losses * token_weights(batch)`` over the sum of the weights
    is the mean over the batch's trained targets; ``None`` (neither packed nor
    weighted) means every target counts.

    >>> batch = {"segment_ids": jnp.array([[1, 1, 1, 0]]),
    ...          "loss_weights": jnp.array([[0.0, 1.0, 1.0, 1.0]])}
    >>> token_weights(batch)
    Array([[0., 1., 0., 0.]], dtype=float32)
    """
    packed = target_weights(batch)
    weights = batch.get("loss_weights")
    if weights is None:
        return None if packed is None else packed.astype(jnp.float32)
    weights = jnp.asarray(weights, jnp.float32)
    return weights if packed is None else jnp.where(packed, weights, 0.0)
