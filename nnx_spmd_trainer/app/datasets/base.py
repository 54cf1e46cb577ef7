"""What every example dataset returns, and the Grain pipeline they share."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import grain
import numpy as np

from nnx_spmd_trainer.data.grain_input import grain_pipeline

__all__ = ["Splits", "index_batches"]

Batch = dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class Splits:
    """A training stream, a held-out set, and the loss a model must beat.

    Attributes:
      train: batches without end (a Grain ``MapDataset``; ``iter`` gives a
        checkpointable ``DatasetIterator``).
      eval: a finite, re-iterable set of fixed batches.
      baseline: cross entropy (nats) of ``eval`` under a model-free predictor
        fitted on ``train`` (character or label frequencies).
      baseline_name: what ``baseline`` is, for messages.
    """

    train: Iterable[Batch]
    eval: Iterable[Batch]
    baseline: float
    baseline_name: str


def index_batches(
    num_examples: int,
    batch_size: int,
    gather: Callable[[np.ndarray], Batch],
    *,
    seed: int | None = None,
    repeat: bool = False,
    shard: tuple[int, int] = (0, 1),
) -> grain.MapDataset[Any]:
    """A Grain pipeline over example indices: shuffle, repeat, shard, batch, gather
    (``grain_pipeline`` from this process's batch size).

    Indices are batched first and ``gather`` turns a batch of indices into
    arrays in one vectorised call, instead of one Python call per example.

    Args:
      num_examples: indices run over ``range(num_examples)``.
      batch_size: rows per batch (this process's part of the global batch);
        the remainder that does not fill a batch is dropped.
      gather: ``int64 indices (batch_size,) -> {name: array (batch_size, ...)}``.
      seed: shuffle with this seed (a fresh permutation every epoch); ``None``
        keeps the order.
      repeat: repeat without end.
      shard: ``(index, count)``: this process reads every ``count``-th
        example starting at ``index``.
    """
    return grain_pipeline(
        num_examples, batch_size * shard[1], shard, seed=seed, repeat=repeat, batch_fn=gather
    )
