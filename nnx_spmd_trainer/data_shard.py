"""Which part of a batch each process feeds, read from the batch's ``PartitionSpec``.

The fed dimension (``fed_dimension``: the first dimension a spec splits, else the
rows), the global shape the processes' slices make (``global_batch_shape``), and
the ``DataShard`` a process feeds (``data_shard_of``). Pure functions of specs,
axis names and process ids: no devices needed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from jax.sharding import PartitionSpec as P

from nnx_spmd_trainer.sharding import ShardingError, dimension_axes


class FedDimension(NamedTuple):
    """The dimension of a batch leaf that processes split between them, and its mesh axes.

    Each process feeds its slice of this dimension; the global array is
    ``DataShard.count`` times a process's along it, and the same along every
    other dimension.

    >>> FedDimension(dim=1, axes=("data",))
    FedDimension(dim=1, axes=('data',))
    """

    dim: int
    axes: tuple[str, ...]


def fed_dimension(spec: P) -> FedDimension:
    """Which dimension of a batch leaf laid out as ``spec`` the processes feed.

    The first dimension the spec splits over mesh axes, with those axes; the
    leading (rows) dimension with no axes if the spec splits none. One answer
    for every reader: ``data.check_batch``, ``data.rows_multiple``,
    ``data.transfer_batch`` and ``Strategy.data_shard``.

    >>> fed_dimension(P("data")), fed_dimension(P(None, ("fsdp", "model")))
    (FedDimension(dim=0, axes=('data',)), FedDimension(dim=1, axes=('fsdp', 'model')))
    >>> fed_dimension(P())
    FedDimension(dim=0, axes=())
    """
    for dim, axes in enumerate(dimension_axes(spec)):
        if axes:
            return FedDimension(dim, axes)
    return FedDimension(0, ())


def global_batch_shape(shape: Sequence[int], spec: P, data_shards: int) -> tuple[int, ...]:
    """The global shape of a batch leaf whose processes each hold ``shape``, laid out as
    ``spec``: ``data_shards`` times larger along the fed dimension, the same elsewhere.

    >>> global_batch_shape((4, 6), P(None, "data"), 2), global_batch_shape((4, 6), P("data"), 2)
    ((4, 12), (8, 6))
    """
    fed = fed_dimension(spec).dim
    return tuple(n * data_shards if d == fed else n for d, n in enumerate(shape))


class DataShard(NamedTuple):
    """Which rows one process feeds: the ``index``-th of ``count`` equal slices.

    Read a global dataset as ``rows[index::count]`` or ``ds.shard(count, index)``;
    processes with the same index feed the same rows.

    >>> DataShard(index=1, count=2)
    DataShard(index=1, count=2)
    """

    # The names the question uses; they shadow tuple's index()/count() methods, unused here.
    index: int  # type: ignore[assignment]
    count: int  # type: ignore[assignment]


def data_shard_of(
    process_ids: np.ndarray,
    axis_names: Sequence[str],
    batch_axes: Sequence[str],
    process_index: int,
) -> DataShard:
    """The rows ``process_index`` feeds, given which process owns each mesh device.

    A device's batch-shard number is its coordinate along ``batch_axes``
    (row-major, in that order). Each process must hold one contiguous,
    aligned block of shard numbers, the same size for every process; its
    index is the block's start over its size. Devices that differ only
    along other axes (a model axis) hold the same rows, so processes split
    only along such an axis feed the same rows.

    Args:
      process_ids: the owning process of every device, shaped like the mesh.
      axis_names: the mesh's axis names, one per dimension of ``process_ids``.
      batch_axes: the mesh axes splitting the batch's leading dimension.
      process_index: the process asking.

    >>> ids = np.array([[0, 0], [0, 0], [1, 1], [1, 1]])  # 4x2 mesh, two hosts
    >>> data_shard_of(ids, ("fsdp", "model"), ("fsdp",), 1)
    DataShard(index=1, count=2)
    """
    process_ids = np.asarray(process_ids)
    names = tuple(axis_names)
    shape = dict(zip(names, process_ids.shape, strict=True))
    where = f"mesh {shape}, batch axes {tuple(batch_axes)}"
    missing = [a for a in batch_axes if a not in names]
    if missing:
        raise ShardingError(f"{where}: batch axes {missing} are not mesh axes.")
    if process_index not in process_ids:
        raise ShardingError(
            f"{where}: process {process_index} owns no device of the mesh "
            f"(processes {sorted({int(p) for p in process_ids.flat})}). Build the mesh over "
            "every process's devices."
        )
    # Batch axes first, in the spec's order, then the rest: a flat shard number per row.
    order = [names.index(a) for a in batch_axes]
    order += [d for d in range(process_ids.ndim) if d not in order]
    count = math.prod(process_ids.shape[d] for d in order[: len(batch_axes)])
    by_shard = np.transpose(process_ids, order).reshape(count, -1)
    blocks: dict[int, tuple[int, int]] = {}
    for process in sorted({int(p) for p in by_shard.flat}):
        shards = np.flatnonzero((by_shard == process).any(axis=1))
        blocks[process] = (int(shards[0]), len(shards))
        if shards[-1] - shards[0] + 1 != len(shards) or shards[0] % len(shards):
            raise ShardingError(
                f"{where}: process {process} holds batch shards {shards.tolist()} of {count}, "
                "not one contiguous, aligned block, so it cannot feed one slice of the "
                "batch. Order the mesh's devices process by process along the batch axes "
                "(jax.make_mesh does), or put the axes that span processes first."
            )
    sizes = {process: size for process, (_, size) in blocks.items()}
    if len(set(sizes.values())) > 1:
        raise ShardingError(
            f"{where}: processes hold unequal numbers of batch shards ({sizes}), so "
            "they cannot feed equal slices. "
            "Give every process the same number of devices along the batch axes."
        )
    start, size = blocks[process_index]
    return DataShard(index=start // size, count=count // size)
