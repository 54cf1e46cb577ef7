"""The usual Grain input pipeline of one process, from the global batch size and the layout."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grain

from nnx_spmd_trainer.data_shard import DataShard


def grain_pipeline(
    source: int | Any,
    global_batch_size: int,
    shard: DataShard | tuple[int, int] = (0, 1),
    *,
    seed: int | None = 0,
    repeat: bool = True,
    map_fn: Callable[[Any], Any] | None = None,
    batch_fn: Callable[[Any], Any] | None = None,
) -> grain.MapDataset[Any]:
    """source -> shuffle -> repeat -> this process's rows -> map -> batch -> batch_fn.

    Every process shuffles the same global order (``seed``; Grain gives each
    repetition, each epoch, its own permutation) and then takes its rows,
    ``rows[index::count]`` for ``shard = trainer.placement.data_shard``, batched to its
    part of the global batch. So a global batch holds the same examples
    whatever the number of processes, and a checkpoint's data position moves
    between process counts.

    Args:
      source: an ``int`` n (the example indices ``range(n)``) or any random-access
        source (a list, a ``grain.sources`` source).
      global_batch_size: examples per training step over all processes.
      shard: which rows this process feeds (``trainer.placement.data_shard`` or
        ``strategy.data_shard(mesh)``).
      seed: the shuffle seed; ``None`` keeps the source's order.
      repeat: repeat without end (one ``fit`` epoch then runs until ``max_steps``).
      map_fn: applied to each example before batching.
      batch_fn: applied to each batch, vectorised (e.g. gathering arrays by index).

    >>> ds = grain_pipeline(10, 4, DataShard(1, 2), seed=None, repeat=False)
    >>> [b.tolist() for b in ds]
    [[1, 3], [5, 7]]
    """
    index, count = shard
    if not 0 <= index < count:
        raise ValueError(f"shard must be (index, count) with 0 <= index < count, got {shard}.")
    if global_batch_size % count:
        raise ValueError(
            f"A global batch of {global_batch_size} examples cannot be split between the "
            f"{count} processes that feed distinct rows; use a multiple of {count}."
        )
    dataset = (
        grain.MapDataset.range(source)
        if isinstance(source, int)
        else grain.MapDataset.source(source)
    )
    if seed is not None:
        dataset = dataset.shuffle(seed=seed)
    if repeat:
        dataset = dataset.repeat(None)  # after the shuffle: each epoch its own permutation
    if count > 1:
        dataset = dataset[index::count]
    if map_fn is not None:
        dataset = dataset.map(map_fn)
    dataset = dataset.batch(global_batch_size // count, drop_remainder=True)
    return dataset.map(batch_fn) if batch_fn is not None else dataset
