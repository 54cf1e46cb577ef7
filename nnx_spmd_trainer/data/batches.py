"""Batches onto the devices: checked against their shardings, padded, transferred.

``place_batch`` is ``check_batch`` then ``transfer_batch``; ``rows_multiple`` and
``pad_batch`` make a batch whose rows do not divide fit (``Trainer.padded``). The
``Placement`` (placement.py) asks the plan for the shardings (``BatchLayout``: the plan
asks its strategy) and calls these.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from nnx_spmd_trainer.data_shard import fed_dimension, global_batch_shape
from nnx_spmd_trainer.sharding import ShardingError, dimension_axes


def batch_kind(batch: Any, *extra: Any) -> tuple[Any, ...]:
    """What a batch's shardings, checks and compiled steps depend on, hashable: its tree
    structure and each leaf's shape and dtype (with ``extra``). Asked once or twice a
    step, so it reads attributes and builds no dtype names (``str(dtype)`` alone costs
    microseconds a leaf)."""
    leaves, treedef = jax.tree.flatten(batch)
    kinds = [(x.shape, x.dtype) if hasattr(x, "dtype") else (np.shape(x), type(x)) for x in leaves]
    return (treedef, tuple(kinds), *extra)


def place_batch(batch: Any, shardings: Any, *, divisor: int = 1, data_shards: int = 1) -> Any:
    """Turns this process's batch into global ``jax.Array`` s with the given shardings.

    With several processes each contributes its rows
    (``jax.make_array_from_process_local_data``); with one, the same layout
    comes from a single batched ``jax.device_put``. A leaf that is already a
    ``jax.Array`` is resharded on the devices if needed, never copied to the host.

    Args:
      batch: a pytree of arrays holding this process's rows of the global batch.
      shardings: a NamedSharding per leaf (the strategy's answer).
      divisor: extra factor the per-shard batch must divide (gradient accumulation).
      data_shards: how many distinct row sets the processes feed
        (``strategy.data_shard(mesh).count``): the global batch is this many
        times a process's rows. Processes that share rows (a model axis spanning
        processes) count once.
    """
    check_batch(batch, shardings, divisor=divisor, data_shards=data_shards)
    return transfer_batch(batch, shardings, data_shards=data_shards)


def check_batch(batch: Any, shardings: Any, *, divisor: int = 1, data_shards: int = 1) -> None:
    """Raises a ShardingError naming the leaf if the batch cannot take ``shardings``.

    Every dimension is checked against its own mesh axes: the global size
    divides the product of their sizes. The rows (dimension 0) also divide
    into ``divisor`` microbatches; the fed dimension (``data_shard.fed_dimension``:
    the first one the spec splits) is ``data_shards`` times this process's.
    """

    def check(path: Any, x: Any, sharding: NamedSharding) -> None:
        shape = np.shape(x)
        where = f"batch leaf {jax.tree_util.keystr(path) or '<root>'} with shape {shape}"
        if not shape:
            raise ShardingError(
                f"{where} is a scalar; every batch leaf needs a leading batch dimension. "
                "Give it one (e.g. np.full((batch_size,), value))."
            )
        spec, mesh = sharding.spec, dict(sharding.mesh.shape)
        if len(spec) > len(shape):
            raise ShardingError(
                f"{where}: its batch sharding {spec} on mesh {mesh} has {len(spec)} entries "
                f"for {len(shape)} dimensions. Give the leaf the dimensions the strategy's "
                "batch_sharding splits, or return a spec with one entry per dimension at most."
            )
        sizes = shape if _is_global(x) else global_batch_shape(shape, spec, data_shards)
        for dim, axes in enumerate(dimension_axes(spec, len(shape))):
            parts = math.prod(mesh[a] for a in axes)
            microbatches = divisor if dim == 0 else 1
            size = sizes[dim]
            if size % (parts * microbatches) == 0:
                continue
            if dim == 0:
                accum = f" x {divisor} microbatches" if divisor > 1 else ""
                raise ShardingError(
                    f"{where}: a global batch of {size} rows cannot be split over the batch "
                    f"axes {spec} of mesh {mesh} ({parts} parts{accum}). Use a batch_size "
                    f"divisible by {parts * divisor}, or pad the batch with Trainer.padded "
                    "(a 'mask' marks the padding)."
                )
            raise ShardingError(
                f"{where}: dimension {dim} of global size {size} cannot be split over the "
                f"mesh axes {axes} of its batch sharding {spec} on mesh {mesh} ({parts} "
                f"parts). Make dimension {dim} of every batch divisible by {parts} (pad it), "
                "or split it over other axes in the strategy's batch_sharding."
            )

    jax.tree_util.tree_map_with_path(check, batch, shardings)


def rows_multiple(shardings: Any, *, divisor: int = 1, data_shards: int = 1) -> int:
    """The number a process's batch rows must be a multiple of to take ``shardings``.

    The rows (dimension 0) divide the mesh axes splitting them times
    ``divisor``; a leaf whose fed dimension is the rows needs only its share
    of that, as the global rows are ``data_shards`` times this process's.
    Other dimensions are not rows: ``check_batch`` checks them.
    """

    def one(s: NamedSharding) -> int:
        parts = math.prod(s.mesh.shape[a] for a in dimension_axes(s.spec, 1)[0]) * divisor
        shards = data_shards if fed_dimension(s.spec).dim == 0 else 1
        return parts // math.gcd(parts, shards)

    return math.lcm(1, *(one(s) for s in jax.tree.leaves(shardings)))


def pad_batch(batch: Any, multiple: int) -> Any:
    """``batch`` (a dict of arrays) with its rows padded up to a multiple of ``multiple``,
    and a ``"mask"`` that is 1 on its rows and 0 on the padding.

    Padding repeats the last row, so every value stays one the model can take
    (no ``log(0)``); the mask keeps the padding out of the metrics and, through
    ``masked_mean``, out of the loss. A batch that already has a mask keeps it,
    padded with 0.
    """
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"Only a dict batch can be padded (it carries the 'mask'); got a "
            f"{type(batch).__name__}. Yield dicts, or batches whose rows divide {multiple}."
        )
    rows = len(jax.tree.leaves(batch)[0])
    mask = np.asarray(batch.get("mask", np.ones(rows, np.float32)))
    missing = -rows % multiple
    if not missing:
        return {**batch, "mask": mask}

    def pad(x: Any) -> np.ndarray:
        x = np.asarray(x)
        return np.concatenate([x, np.repeat(x[-1:], missing, axis=0)])

    padded = jax.tree.map(pad, {k: v for k, v in batch.items() if k != "mask"})
    return {**padded, "mask": np.concatenate([mask, np.zeros(missing, mask.dtype)])}


def _is_global(x: Any) -> bool:
    """A jax.Array already laid out over the devices (not this process's host rows)."""
    return isinstance(x, jax.Array) and (jax.process_count() == 1 or not x.is_fully_addressable)


def transfer_batch(batch: Any, shardings: Any, *, data_shards: int = 1) -> Any:
    """Places an already checked batch: no validation, one batched transfer where possible."""
    if jax.process_count() == 1:  # one batched transfer for all leaves
        return jax.device_put(batch, shardings)

    def one(x: Any, sharding: NamedSharding) -> jax.Array:
        if _is_global(x):
            return jax.device_put(x, sharding)
        x = np.asarray(x)
        global_shape = global_batch_shape(x.shape, sharding.spec, data_shards)
        return jax.make_array_from_process_local_data(sharding, x, global_shape)

    return jax.tree.map(one, batch, shardings)
