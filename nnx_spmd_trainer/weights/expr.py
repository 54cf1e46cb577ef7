"""Lazy tensor expressions: how one model array is made from a file's tensors.

An expression is a small frozen dataclass with a shape and a dtype. ``read(index,
tensors)`` gives only the block ``index`` (one slice per dimension) of the result,
reading only what that block needs from the named tensors, so a device's shard
is read without the whole tensor (``jax.make_array_from_callback`` asks for one
block per device). ``invert(piece)`` runs the other way, for export: given a
block of the result, it says which block of which named tensor it fills.

The transforms (``transpose``, ``reshape``, ``split``, ``stack``, ``pad``, ...)
are in ``transforms.py``.

>>> import numpy as np
>>> w = tensor("wpe.weight", (4, 3))
>>> w.read((slice(1, 3), slice(0, 3)), {"wpe.weight": np.arange(12.0).reshape(4, 3)})
array([[3., 4., 5.],
       [6., 7., 8.]])
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

#: One slice per dimension, each with a concrete start and stop and no step.
Index = tuple[slice, ...]


class Tensors(Protocol):
    """Name -> an array-like whose ``[index]`` reads that block (a memory map, NumPy, ...)."""

    def __getitem__(self, name: str, /) -> Any: ...


__all__ = ["Expr", "Index", "Piece", "Tensor", "Tensors", "full_index", "normalize_index", "tensor"]


def full_index(shape: Sequence[int]) -> Index:
    """The whole array: ``slice(0, n)`` for every dimension."""
    return tuple(slice(0, n) for n in shape)


def normalize_index(index: Sequence[slice], shape: Sequence[int]) -> Index:
    """``index`` (as ``jax.make_array_from_callback`` gives it, ``slice(None)`` allowed)
    with concrete bounds."""
    out = []
    for s, n in zip(index, shape, strict=True):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"only unit-step slices are read, got {s}")
        out.append(slice(start, max(start, stop)))
    return tuple(out)


@dataclass(frozen=True)
class Piece:
    """A block of an array, for export: ``value`` fills ``[at[i], at[i] + shape[i])``."""

    value: Expr
    at: tuple[int, ...]


class Expr(ABC):
    """A lazily read array: shape, dtype, block reads and their inverse."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @abstractmethod
    def read(self, index: Index, tensors: Tensors) -> np.ndarray:
        """The block ``index`` of this array, reading only what it needs from ``tensors``."""

    @abstractmethod
    def leaves(self) -> Iterator[Tensor]:
        """The named tensors this expression reads."""

    @abstractmethod
    def invert(self, piece: Piece) -> Iterator[tuple[str, Piece]]:
        """Where a block of this array goes: ``(tensor name, block of that tensor)``."""


@dataclass(frozen=True)
class Tensor(Expr):
    """A named tensor of the source, declared with the shape and dtype it must have."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype = field(default=np.dtype(np.float32))

    def read(self, index: Index, tensors: Tensors) -> np.ndarray:
        # A copy: a block of a memory map handed to a device must not alias the file's pages.
        return np.array(tensors[self.name][index])

    def leaves(self) -> Iterator[Tensor]:
        yield self

    def invert(self, piece: Piece) -> Iterator[tuple[str, Piece]]:
        yield self.name, piece


def tensor(name: str, shape: Sequence[int], dtype: Any = np.float32) -> Tensor:
    """The tensor ``name`` of the source, which must have ``shape`` and ``dtype``."""
    return Tensor(name, tuple(int(n) for n in shape), np.dtype(dtype))
