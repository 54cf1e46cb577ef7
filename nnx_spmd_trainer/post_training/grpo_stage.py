"""GRPO's rollout as a data stage before placement: the batches of prompt indices ``fit``
is given become, one at a time as the loop asks for the next, this process's host batch of
a rollout (``GRPOTrainer.rollout``), which the loop then places once, as any batch.

The stage reads the live model when the loop asks, after the step before has finished, so
it never runs ahead of training (``GRPOTrainer`` builds its ``Trainer`` with
``prefetch=0``: a batch sampled ahead would be sampled from older weights). Its position
is its prompt batches' position: a Grain dataset (or a list, read as one) resumes at the
saved batch without sampling the batches before it.

With several processes each feeds its rows of the prompt indices (its ``data_shard``, as
any batch); the stage reads the whole batch's indices from every process (a few integers,
``global_rows``) before sampling, since every process samples every prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import grain
import jax
import numpy as np
from jax.experimental import multihost_utils

from nnx_spmd_trainer.data.position import has_position
from nnx_spmd_trainer.data_shard import DataShard

__all__ = ["RolloutStage", "global_rows"]


def global_rows(rows: np.ndarray, shard: DataShard) -> np.ndarray:
    """The global batch's prompt indices from this process's ``rows``: the processes'
    rows in the order of their data shards (the order ``Placement.place`` lays them out
    in); ``rows`` itself when one shard feeds every row."""
    rows = np.asarray(rows, np.int64)
    if shard.count == 1 or jax.process_count() == 1:
        return rows
    tagged = np.concatenate([[shard.index], rows]).astype(np.int64)
    every = np.asarray(multihost_utils.process_allgather(tagged, tiled=False))
    by_shard = {int(row[0]): row[1:] for row in every}
    return np.concatenate([by_shard[i] for i in range(shard.count)])


class RolloutStage:
    """An iterable of host rollout batches: each batch ``{"row": int32[prompts]}`` of
    ``data``, when asked for, becomes ``produce(batch["row"])``.

    A list or tuple of batches is read as a ``grain.MapDataset``, so a resumed run seeks to
    its batch without sampling the ones before it.
    """

    def __init__(
        self, produce: Callable[[np.ndarray], dict[str, np.ndarray]], data: Iterable[Any]
    ) -> None:
        if isinstance(data, Sequence) and not isinstance(data, (str, bytes)):
            data = grain.MapDataset.source(list(data))
        self.produce, self.data = produce, data

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        inner = iter(self.data)
        if has_position(inner):
            return _PositionedRollouts(self.produce, inner)
        return _Rollouts(self.produce, inner)


class _Rollouts:
    """The stage's iterator over an iterator without a position."""

    def __init__(self, produce: Callable[[np.ndarray], Any], inner: Iterator[Any]) -> None:
        self.produce, self.inner = produce, inner

    def __iter__(self) -> _Rollouts:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = next(self.inner)
        if not isinstance(batch, dict) or "row" not in batch:
            raise TypeError(
                "GRPOTrainer.fit takes batches of prompt indices {'row': int32[prompts]} "
                f"(rollout.prompt_batches); got {type(batch).__name__}."
            )
        return self.produce(np.asarray(batch["row"]))  # type: ignore[no-any-return]


class _PositionedRollouts(_Rollouts):
    """The same over a Grain iterator: its position is the stage's."""

    def get_state(self) -> Any:
        return self.inner.get_state()  # type: ignore[attr-defined]

    def set_state(self, state: Any) -> None:
        self.inner.set_state(state)  # type: ignore[attr-defined]
