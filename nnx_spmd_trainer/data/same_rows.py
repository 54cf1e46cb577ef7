"""Processes that feed the same rows: batch fingerprints, and the verdict when they differ.

``Placement`` (placement.py) gathers every process's ``batch_fingerprint`` of the
first batch of each kind through the coordination service; ``same_rows_error``
turns them into the message every process raises.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

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
