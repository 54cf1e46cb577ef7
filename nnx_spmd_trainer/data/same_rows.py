"""Processes that feed the same rows: batch fingerprints, the check, and the verdict.

``Placement`` (placement.py) calls ``check_same_rows`` for the first batch of each
kind: every process's ``DataShard``, shapes and ``batch_fingerprint`` are gathered
through ``distributed.agree`` (the one place processes exchange host values), and
``same_rows_error`` turns them into the message every process raises.
"""

from __future__ import annotations

import threading
import warnings
import zlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from nnx_spmd_trainer.data_shard import DataShard
from nnx_spmd_trainer.distributed import agree
from nnx_spmd_trainer.sharding import ShardingError

#: How long a process waits for the others at a check of the rows they feed.
ROWS_CHECK_TIMEOUT_S = 300

_CHUNK = 1 << 20  # bytes weighted at a time: bounds the temporary arrays


def _position_weights(start: int, size: int) -> np.ndarray:
    """An odd, well-mixed ``uint32`` per byte position (murmur3's finaliser of the index).

    Odd, so a change of any one byte always changes the sum; mixed, so swapping two
    rows with equal byte sums (a linear weight's blind spot) changes it too."""
    h = np.arange(start, start + size, dtype=np.uint64).astype(np.uint32)
    h ^= h >> np.uint32(16)
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> np.uint32(13)
    h *= np.uint32(0xC2B2AE35)
    h ^= h >> np.uint32(16)
    return h | np.uint32(1)


def leaf_fingerprint(x: Any) -> int:
    """A ``uint32`` checksum of one host array: its shape and dtype, and the wrapping sum
    of its bytes (row-major) each times a hash of its position.

    A global ``jax.Array`` (laid out over the devices already, the same on every
    process) counts by its shape and dtype alone.
    """
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return zlib.crc32(f"global {x.shape} {x.dtype}".encode())
    array = np.ascontiguousarray(x)
    raw = array.reshape(-1).view(np.uint8)
    total = zlib.crc32(f"{array.shape} {array.dtype}".encode())
    for start in range(0, raw.size, _CHUNK):
        part = raw[start : start + _CHUNK].astype(np.uint32)
        part *= _position_weights(start, part.size)
        total += int(np.sum(part, dtype=np.uint32))
    return total % 2**32


def batch_fingerprint(batch: Any) -> list[int]:
    """One ``leaf_fingerprint`` per leaf of this process's batch, computed on the host.

    Two processes' batches of one structure have equal fingerprints if they are
    equal, and (but for a chance near 2**-32 per leaf) differ if any row does.

    >>> a = {"x": np.arange(6).reshape(3, 2)}
    >>> batch_fingerprint(a) == batch_fingerprint({"x": np.arange(6).reshape(3, 2)})
    True
    >>> batch_fingerprint(a) == batch_fingerprint({"x": np.arange(6).reshape(3, 2)[::-1]})
    False
    """
    return [leaf_fingerprint(x) for x in jax.tree.leaves(batch)]


def same_rows_error(
    shards: Sequence[Sequence[int]],
    fingerprints: Sequence[Sequence[int]],
    leaf_names: Sequence[str],
    *,
    shapes: Sequence[Sequence[tuple[int, ...]]] | None = None,
) -> str | None:
    """What is wrong, if processes that feed the same rows fed different batches.

    ``shards[p]`` is process ``p``'s ``DataShard(index, count)``, ``fingerprints[p]``
    its ``batch_fingerprint`` of a batch of the same structure and ``shapes[p]``
    (optional) that batch's leaf shapes; gathered from every process, so every
    process reaches the same answer. Processes with the same ``index`` must feed
    equal batches; each one whose batch differs from the lowest such process's is
    named. ``None`` when all agree.
    """
    groups: dict[int, list[int]] = {}
    for process, (index, _) in enumerate(shards):
        groups.setdefault(index, []).append(process)
    problems = []
    for index, processes in sorted(groups.items()):
        first = processes[0]
        for process in processes[1:]:
            if list(fingerprints[process]) == list(fingerprints[first]):
                continue
            pairs = zip(leaf_names, fingerprints[process], fingerprints[first], strict=False)
            leaves = [name for name, a, b in pairs if a != b]
            if len(fingerprints[process]) != len(fingerprints[first]):
                leaves.append("(a different number of leaves)")
            what = f"leaves {', '.join(leaves[:4])}"
            if shapes is not None and list(shapes[process]) != list(shapes[first]):
                what += f"; shapes {list(shapes[process])[:4]} against {list(shapes[first])[:4]}"
            problems.append(
                f"process {process} fed a batch unlike process {first}'s ({what}), though "
                f"both feed the rows of DataShard(index={index}, count={shards[process][1]})"
            )
    if not problems:
        return None
    whole = (
        " (count=1: every process feeds the whole global batch; a model axis spans the processes)"
        if {count for _, count in shards} == {1}
        else ""
    )
    return (
        "nnx_spmd_trainer: " + "; ".join(problems) + ". Processes that trainer.placement."
        f"data_shard gives the same index must feed the same rows{whole}, or the step trains "
        "on a global batch nobody fed. Feed each process its data_shard: the index-th of "
        "count equal slices of each global batch (rows[index::count], ds.shard(count, index), "
        "or grain_pipeline), not a slice per process."
    )


def _leaf_names(batch: Any) -> list[str]:
    return [
        jax.tree_util.keystr(p) or "<root>" for p, _ in jax.tree_util.tree_leaves_with_path(batch)
    ]


def structure(batch: Any) -> str:
    """A batch's leaf paths as the same text on every process (not the treedef's text: a
    custom node's may hold an object's address), and which thread places it: each thread
    places its batches in the same order on every process, two threads need not."""
    thread = "main" if threading.current_thread() is threading.main_thread() else "other"
    return f"{{{', '.join(_leaf_names(batch))}}} placed by the {thread} thread"


def topic(batch: Any) -> str:
    """What a check of batches like ``batch`` agrees on (``agree``'s topic): its
    ``structure``. Shapes are compared, not part of the topic, so a process feeding
    another number of rows is named instead of waited for."""
    return f"same rows of {structure(batch)}"


def check_same_rows(batch: Any, data_shard: DataShard) -> None:
    """Raises on every process if processes that ``data_shard`` says feed the same rows
    fed different batches (multi-process runs only; ``Placement.place`` calls it for
    the first batch of each kind).

    Each process's ``DataShard``, its batch's shapes and ``batch_fingerprint(batch)``
    are agreed on (``agree.all_values``) under the batch's ``topic``: all processes see
    the same values, so all reach the same verdict and raise together.
    """
    if jax.process_count() == 1:
        return
    agreement = agree.Agreement.current()
    if agreement is None:  # pragma: no cover - JAX moved its client
        warnings.warn(
            "nnx_spmd_trainer: JAX's distributed client was not found, so the processes "
            "cannot check that those feeding the same rows (trainer.placement.data_shard) "
            "agree.",
            stacklevel=3,
        )
        return
    mine = {
        "shard": list(data_shard),
        "shapes": [list(np.shape(x)) for x in jax.tree.leaves(batch)],
        "fingerprints": batch_fingerprint(batch),
    }
    try:
        reports = agreement.all_values(topic(batch), mine, timeout_s=ROWS_CHECK_TIMEOUT_S)
    except agree.PeerMissing as error:
        raise RuntimeError(
            f"nnx_spmd_trainer: process {error.process} did not place a batch like "
            f"{structure(batch)[:200]} within {ROWS_CHECK_TIMEOUT_S} s of process "
            f"{jax.process_index()}, to check that processes with the same "
            "trainer.placement.data_shard feed equal batches. Every process must place "
            "the same kinds of batches (structure and shapes), in the same order."
        ) from error
    problem = same_rows_error(
        [r["shard"] for r in reports],
        [r["fingerprints"] for r in reports],
        _leaf_names(batch),
        shapes=[[tuple(s) for s in r["shapes"]] for r in reports],
    )
    if problem:
        raise ShardingError(problem)
