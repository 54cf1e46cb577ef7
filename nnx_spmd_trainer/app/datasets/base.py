"""What every example dataset returns, and the Grain input pipeline they share."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any

import grain
import numpy as np

from nnx_spmd_trainer import grain_pipeline

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
      bytes_per_target: UTF-8 bytes the evaluated targets decode to, per target, for a
        text task (``None``: not text): a loss in nats per token is
        ``nats / ln 2 / bytes_per_target`` bits per byte, comparable across tokenizers.
      tokenizer: what the text was tokenized with, saved with the run
        (``Tokenizer.save``); ``None``: nothing to save.
      summary: lines a dry run prints about the data (corpus sizes, the mixture, the
        epochs of each source in ``config.max_steps``).
      codec: encodes and decodes text for sampling (``nnx-spmd-train generate``) where
        the run saves no ``tokenizer`` (characters, GPT-2's bytes); ``None``: the
        ``tokenizer``.
    """

    train: Iterable[Batch]
    eval: Iterable[Batch]
    baseline: float
    baseline_name: str
    bytes_per_target: float | None = None
    tokenizer: Any = dataclasses.field(default=None, repr=False, compare=False)
    summary: tuple[str, ...] = ()
    codec: Any = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def text_codec(self) -> Any:
        """What turns the task's text into its ids and back (``None``: not text)."""
        return self.codec if self.codec is not None else self.tokenizer

    def bits_per_byte(self, nats_per_target: float) -> float | None:
        """A held-out loss (nats per target token) in bits per UTF-8 byte; ``None`` when
        the task is not text.

        >>> Splits([], [], 1.0, "", bytes_per_target=2.0).bits_per_byte(math.log(4))
        1.0
        """
        if not self.bytes_per_target:
            return None
        return nats_per_target / math.log(2) / self.bytes_per_target

    def bits_per_byte_line(self, eval_loss: float) -> str | None:
        """``eval_loss`` and the baseline in bits per byte, as the run's last lines say it."""
        bits, baseline = self.bits_per_byte(eval_loss), self.bits_per_byte(self.baseline)
        if bits is None or baseline is None:
            return None
        return (
            f"held-out bits per byte {bits:.4f} ({self.baseline_name} {baseline:.4f} bits per "
            f"byte; {self.bytes_per_target:.3f} UTF-8 bytes per token)"
        )


def index_batches(
    num_examples: int,
    batch_size: int,
    gather: Callable[[np.ndarray], Batch],
    *,
    seed: int | None = None,
    repeat: bool = False,
    shard: tuple[int, int] = (0, 1),
) -> grain.MapDataset[Any]:
    """A Grain input pipeline over example indices: shuffle, repeat, shard, batch, gather
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
