"""Fingerprints of array leaves, computed on the devices without gathering anything.

Orbax keeps no checksum of array data: a flipped byte restores silently as a
wrong value (measured with orbax-checkpoint 0.12.8). A fingerprint per leaf,
saved beside the arrays and recomputed after a restore, catches that. Each
one is the wrapping ``uint32`` sum of the leaf's 32-bit words weighted by their position,
``bits[i] * ((2 * i + 1) * 2654435761)``. Integer addition is associative, so
the value is the same for any sharding, any device count and a NumPy copy.
Every weight is odd, so any one-bit flip changes the sum (an even weight, as in
``i * 2654435761 + 1`` for odd ``i``, misses a flip of the top bit).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from nnx_spmd_trainer import path_str
from nnx_spmd_trainer.adapters.orbax_private import JsonWrittenLater

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}
#: How a record names its leaves: 2 is ``path_str``; a record without the key (written
#: before 0.1.0) used ``_legacy_path_str``, and is still checked under those names.
PATHS_VERSION = 2


def _legacy_path_str(path: Sequence[Any]) -> str:
    """``path_str`` as it was before 0.1.0: every ``value`` key left out (``mha/value/kernel``
    read ``mha/kernel``). Records written then name their leaves this way."""
    names = (getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)
    return "/".join(str(name) for name in names if name != "value")


def _leaf_fingerprint(x: jax.Array) -> jax.Array:
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    width = x.dtype.itemsize
    # 8-byte values become pairs of uint32 words; narrower ones widen to uint32.
    bits = jax.lax.bitcast_convert_type(x, _UINT[min(width, 4)]).astype(jnp.uint32)
    # The row-major flat index from one iota per dimension: no reshape, so a sharded
    # array is weighted where it lies and nothing moves between devices but the sum.
    index = jnp.zeros(bits.shape, jnp.uint32)
    for dim in range(bits.ndim):
        index = index * jnp.uint32(bits.shape[dim]) + jax.lax.broadcasted_iota(
            jnp.uint32, bits.shape, dim
        )
    weights = (index * jnp.uint32(2) + jnp.uint32(1)) * jnp.uint32(2654435761)  # all odd
    return jnp.sum(bits * weights, dtype=jnp.uint32)


_fingerprints = jax.jit(lambda leaves: [_leaf_fingerprint(x) for x in leaves])


@jax.jit
def _all_finite(leaves: list[jax.Array]) -> jax.Array:
    checks = [jnp.isfinite(x).all() for x in leaves if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(checks)) if checks else jnp.array(True)


def _host_int(x: Any) -> int:
    # A replicated result: this process's copy is the value, on one process or many.
    return int(np.asarray(x.addressable_data(0) if isinstance(x, jax.Array) else x))


def fingerprints(tree: Any, *, paths_version: int = PATHS_VERSION) -> dict[str, int]:
    """``{leaf path: fingerprint}`` for every array leaf of ``tree`` (one small transfer),
    its leaves named as records of ``paths_version`` name them.

    >>> fingerprints({"w": np.arange(3, dtype=np.float32)}) == fingerprints(
    ...     {"w": jnp.arange(3, dtype=jnp.float32)})
    True
    """
    return _resolve(summarize(tree, paths_version=paths_version))["leaves"]


def summarize(
    tree: Any, *, finite: Any = None, paths_version: int = PATHS_VERSION
) -> dict[str, Any]:
    """Fingerprints and whether every float leaf is finite, dispatched to the devices and
    not waited for: ``{"leaves": {path: scalar}, "finite": scalar}`` of ``jax.Array`` s.

    ``finite``: the part of ``tree`` checked for finiteness (default: all of it)."""
    paths, leaves = zip(*jax.tree_util.tree_flatten_with_path(tree)[0], strict=True)
    values = _fingerprints(list(leaves))
    name = path_str if paths_version == PATHS_VERSION else _legacy_path_str
    return {
        "leaves": {name(p): v for p, v in zip(paths, values, strict=True)},
        "finite": _all_finite(jax.tree.leaves(tree if finite is None else finite)),
        "paths": paths_version,
    }


def _resolve(summary: dict[str, Any]) -> dict[str, Any]:
    """``summarize``'s device scalars as JSON: waits for them to be computed."""
    return {
        "leaves": {path: _host_int(v) for path, v in summary["leaves"].items()},
        "finite": bool(_host_int(summary["finite"])),
        "paths": summary["paths"],
    }


class PendingSummary:
    """A ``summarize`` result handed to Orbax before it exists: the saver sets it right
    after ``save`` returns, and the background write waits for it.

    A save interrupted before ``set`` (Ctrl-C, an error) must ``cancel``: the writer
    then fails at once, instead of keeping the process alive in a thread that waits."""

    def __init__(self) -> None:
        self._ready = threading.Event()
        self._summary: dict[str, Any] | None = None

    def set(self, summary: dict[str, Any]) -> None:
        self._summary = summary
        self._ready.set()

    def cancel(self) -> None:
        """Fails the waiting writer now; a no-op once ``set``."""
        self._ready.set()

    def get(self, timeout: float = 600.0) -> dict[str, Any]:
        if not self._ready.wait(timeout):
            raise TimeoutError("the checkpoint's fingerprints were never computed")
        if self._summary is None:
            raise RuntimeError("the save was interrupted before its fingerprints were computed")
        return self._summary


class FingerprintHandler(JsonWrittenLater):
    """Writes a ``summarize`` result as JSON in Orbax's background commit: the device
    computation overlaps training instead of blocking the save."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(filename="fingerprints.json", **kwargs)

    def to_json(self, item: Any) -> Any:
        summary = item.get() if isinstance(item, PendingSummary) else item
        return _resolve(summary)


@ocp.args.register_with_handler(FingerprintHandler, for_save=True)
@dataclasses.dataclass
class FingerprintSave(ocp.args.CheckpointArgs):
    """A checkpoint item: ``summarize(tree)`` (or a ``PendingSummary`` of it), written
    once the devices computed it."""

    item: Any


@ocp.args.register_with_handler(FingerprintHandler, for_restore=True)
@dataclasses.dataclass
class FingerprintRestore(ocp.args.CheckpointArgs):
    """Reads a ``FingerprintSave`` item back as ``{"leaves": {path: int}, "finite": bool,
    "paths": int}`` (``"paths"`` absent from records written before 0.1.0)."""


def mismatches(
    expected: dict[str, int], tree: Any, *, paths_version: int = PATHS_VERSION
) -> list[str]:
    """The leaf paths of ``tree`` whose fingerprint differs from ``expected`` (or is missing);
    ``paths_version``: how ``expected`` names the leaves (its record's ``"paths"``)."""
    actual = fingerprints(tree, paths_version=paths_version)
    return sorted(p for p in expected.keys() | actual.keys() if expected.get(p) != actual.get(p))
