"""DPO's precomputed reference log-probabilities (TRL's ``precompute_ref_log_probs``): a
table from each pair's tokens to the reference's summed log-probabilities of its two
completions, filled in one pass over the data set before training and kept in a file
with the run, so a resumed run reads it back instead of running the reference again.

A pair is found by a digest of its rows' bytes (inputs, targets and weights of both
sides), so training may visit the pairs in any order and any batch composition.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["ReferenceTable"]

_KEYS = tuple(
    f"{side}_{key}" for side in ("chosen", "rejected") for key in ("inputs", "targets", "weights")
)


def row_digests(batch: Mapping[str, Any]) -> list[bytes]:
    """Each pair's digest: blake2b over its rows of the batch's six pair arrays."""
    arrays = [np.ascontiguousarray(np.asarray(batch[key])) for key in _KEYS]
    rows = arrays[0].shape[0]
    digests = []
    for r in range(rows):
        h = hashlib.blake2b(digest_size=16)
        for array in arrays:
            h.update(str(array.dtype).encode())
            h.update(array[r].tobytes())
        digests.append(h.digest())
    return digests


class ReferenceTable:
    """The reference's ``(chosen, rejected)`` summed log-probabilities of each pair, by the
    digest of its tokens (``row_digests``)."""

    def __init__(self) -> None:
        self._values: dict[bytes, tuple[np.float32, np.float32]] = {}

    def __len__(self) -> int:
        return len(self._values)

    def add(self, batch: Mapping[str, Any], chosen: np.ndarray, rejected: np.ndarray) -> None:
        """Keeps each row's values (``chosen``, ``rejected``: ``[rows]``)."""
        for digest, c, r in zip(row_digests(batch), chosen, rejected, strict=True):
            self._values[digest] = (np.float32(c), np.float32(r))

    def lookup(self, batch: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        """``(chosen, rejected)`` float32 ``[rows]`` of a host batch of pairs; a KeyError
        naming the first row the table does not hold."""
        found = []
        for row, digest in enumerate(row_digests(batch)):
            if digest not in self._values:
                raise KeyError(
                    f"DPO's precomputed reference has no values for row {row} of this batch "
                    f"(its {len(self)} pairs were computed before training): run "
                    "precompute_reference_logps over every batch the run trains and "
                    "evaluates on, or leave precompute_ref_log_probs unset."
                )
            found.append(self._values[digest])
        values = np.asarray(found, np.float32).reshape(-1, 2)
        return values[:, 0].copy(), values[:, 1].copy()

    def save(self, path: str | os.PathLike[str]) -> None:
        """Written whole or not at all: a temporary file in the same folder, renamed."""
        folder = os.path.dirname(os.fspath(path)) or "."
        os.makedirs(folder, exist_ok=True)
        digests = np.frombuffer(b"".join(self._values), np.uint8).reshape(len(self), 16)
        values = np.asarray(list(self._values.values()), np.float32).reshape(len(self), 2)
        handle, temporary = tempfile.mkstemp(dir=folder, suffix=".partial.npz")
        try:
            with os.fdopen(handle, "wb") as file:
                np.savez(file, digests=digests, values=values)
            os.replace(temporary, path)
        except BaseException:
            if os.path.exists(temporary):
                os.remove(temporary)
            raise

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ReferenceTable:
        """The table ``save`` wrote."""
        table = cls()
        with np.load(path) as data:
            for digest, (c, r) in zip(data["digests"], data["values"], strict=True):
                table._values[digest.tobytes()] = (np.float32(c), np.float32(r))
        return table
