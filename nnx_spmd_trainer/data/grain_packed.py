"""Rows packed by Grain's own packers, as the batch the models take.

``grain.experimental.FirstFitPackIterDataset`` (and ``BestFitPackIterDataset``) name
their packed fields after the feature: a ``tokens`` feature comes back as ``tokens``,
``tokens_segment_ids`` and ``tokens_positions``; an ``{"inputs", "targets"}`` pair as
``inputs``, ``inputs_segment_ids``, ``inputs_positions``, ``targets``,
``targets_segment_ids``, ``targets_positions``. ``from_grain_packed`` turns either into
``inputs``, ``targets``, ``segment_ids``, ``positions`` and ``target_segment_ids``
(``nn.packed``), plus ``loss_weights`` when the rows carry a weight feature.

Grain never splits a document, so a row of ``seq_len`` tokens can end inside one (a
document truncated to the row, or one that fills it): the row's last token has no next
token in the row, and its target is given weight 0 (``target_segment_ids`` 0 there), not
trained to predict padding or another row's first token.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["from_grain_packed"]

_SEGMENTS, _POSITIONS = "_segment_ids", "_positions"


def _packed_features(row: Mapping[str, Any]) -> list[str]:
    """The features Grain packed: those with ``<feature>_segment_ids`` beside them."""
    return sorted(k for k in row if f"{k}{_SEGMENTS}" in row and f"{k}{_POSITIONS}" in row)


def _next(values: np.ndarray) -> np.ndarray:
    """Each position's next value along the row (the last axis); 0 after the row's end."""
    shifted = np.zeros_like(values)
    shifted[..., :-1] = values[..., 1:]
    return shifted


def _feature_names(
    row: Mapping[str, Any], inputs: str | None, targets: str | None
) -> tuple[str, str | None]:
    """``(inputs, targets)``: the packed feature(s) to read, as given or found."""
    packed = _packed_features(row)
    if inputs is None and targets is None:
        if {"inputs", "targets"} <= set(packed):
            return "inputs", "targets"
        if len(packed) == 1:
            return packed[0], None
        raise ValueError(
            f"from_grain_packed found the packed features {packed} in a row with keys "
            f"{sorted(row)}; name the one to train on (inputs='tokens'), or the pair "
            "(inputs='inputs', targets='targets')."
        )
    if inputs is None:
        raise ValueError("from_grain_packed: give inputs= with targets= (the pair's two names).")
    for name in (inputs, targets):
        if name is not None and name not in packed:
            raise ValueError(
                f"from_grain_packed: {name!r} is not a feature Grain packed in this row (no "
                f"{name}{_SEGMENTS} / {name}{_POSITIONS} beside it): the row has {sorted(row)}."
            )
    return inputs, targets


def from_grain_packed(
    row: Mapping[str, Any],
    *,
    inputs: str | None = None,
    targets: str | None = None,
    weights: str | None = None,
) -> dict[str, np.ndarray]:
    """The model batch of a row (or a batch of rows) packed by Grain.

    Args:
      row: Grain's packed output: ``{f, f_segment_ids, f_positions, ...}`` per packed
        feature ``f`` (one row of ``[seq]`` or a batch of ``[rows, seq]``).
      inputs: the feature of the tokens. Alone (a ``tokens`` feature: the documents'
        tokens), the targets are the next token of the same row: ``inputs`` ``[:-1]`` and
        ``targets`` ``[1:]`` within a document, the row's last token (a document the
        row ends inside) and each document's last token without a trained target.
        Default: the one packed feature, or ``"inputs"`` when an ``inputs``/``targets``
        pair is packed.
      targets: the feature of the targets when documents were packed as (input,
        target) pairs, each target already the next token of its input.
      weights: a packed per-token weight feature (a chat mask, float or 0/1), aligned
        with ``targets`` for a pair, else with the tokens (then the weight of
        predicting token ``t + 1`` is ``weights[t + 1]``). Out as ``loss_weights``.

    Returns:
      ``inputs``, ``targets``, ``segment_ids``, ``positions``, ``target_segment_ids``
      (and ``loss_weights``), plus the row's other fields as they are; the packed
      features' Grain names are not kept. ``nn.packed.token_weights`` of it trains
      exactly each document's own next-token targets.

    >>> row = {"tokens": np.array([5, 6, 7, 8]), "tokens_segment_ids": np.array([1, 1, 2, 2]),
    ...        "tokens_positions": np.array([0, 1, 0, 1])}
    >>> batch = from_grain_packed(row)
    >>> batch["targets"], batch["target_segment_ids"]
    (array([6, 7, 8, 0]), array([1, 2, 2, 0]))

    Use it as a map of the packed dataset:
    ``FirstFitPackIterDataset(...).map(from_grain_packed).batch(n)``.
    """
    source, paired = _feature_names(row, inputs, targets)
    if weights is not None and weights not in row:
        raise ValueError(
            f"from_grain_packed: weights={weights!r} is not a field of this row: it has "
            f"{sorted(row)}."
        )
    tokens = np.asarray(row[source])
    segments = np.asarray(row[f"{source}{_SEGMENTS}"])
    batch: dict[str, np.ndarray] = {
        "inputs": tokens,
        "segment_ids": segments,
        "positions": np.asarray(row[f"{source}{_POSITIONS}"]),
    }
    if paired is None:
        # The target of token t is token t + 1 when it is in t's document; the row's last
        # token's target is past the row: segment 0, never trained.
        batch["targets"] = _next(tokens)
        batch["target_segment_ids"] = _next(segments)
    else:
        batch["targets"] = np.asarray(row[paired])
        batch["target_segment_ids"] = np.asarray(row[f"{paired}{_SEGMENTS}"])
    if weights is not None:
        weight = np.asarray(row[weights], np.float32)
        batch["loss_weights"] = weight if paired is not None else _next(weight)
    consumed = {weights}
    for name in (source, paired):
        if name is not None:
            consumed |= {name, f"{name}{_SEGMENTS}", f"{name}{_POSITIONS}"}
    if weights is not None:
        consumed |= {f"{weights}{_SEGMENTS}", f"{weights}{_POSITIONS}"}
    rest = {key: np.asarray(value) for key, value in row.items() if key not in consumed}
    return {**rest, **batch}
