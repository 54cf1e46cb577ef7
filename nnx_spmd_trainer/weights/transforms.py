"""The transforms of a lazy expression: each reads a block from blocks of its input
and inverts a block for export (``expr.py`` says how).

>>> import numpy as np
>>> w = tensor("c_attn.weight", (2, 6))
>>> q = split(w, axis=1, parts=3, index=0)
>>> q.shape
(2, 2)
>>> q.read((slice(0, 2), slice(1, 2)), {"c_attn.weight": np.arange(12.0).reshape(2, 6)})
array([[1.],
       [7.]])
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from nnx_spmd_trainer.weights.expr import (
    Expr,
    Index,
    Piece,
    Tensor,
    Tensors,
    full_index,
    tensor,
)

__all__ = [
    "Concat",
    "cast",
    "concat",
    "pad",
    "reshape",
    "split",
    "stack",
    "take",
    "tensor",
    "transpose",
]


def _lengths(index: Index) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in index)


def _replace(index: Index, axis: int, s: slice) -> Index:
    return index[:axis] + (s,) + index[axis + 1 :]


@dataclass(frozen=True)
class _Transpose(Expr):
    x: Expr
    axes: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:  # type: ignore[override]
        return tuple(self.x.shape[a] for a in self.axes)

    @property
    def dtype(self) -> np.dtype:  # type: ignore[override]
        return self.x.dtype

    def read(self, index: Index, tensors: Tensors) -> np.ndarray:
        source = [slice(0, 0)] * len(self.axes)
        for i, a in enumerate(self.axes):
            source[a] = index[i]
        return self.x.read(tuple(source), tensors).transpose(self.axes)

    def leaves(self) -> Iterator[Tensor]:
        return self.x.leaves()

    def invert(self, piece: Piece) -> Iterator[tuple[str, Piece]]:
        inverse = tuple(int(a) for a in np.argsort(self.axes))
        at = [0] * len(self.axes)
        for i, a in enumerate(self.axes):
            at[a] = piece.at[i]
        return self.x.invert(Piece(_Transpose(piece.value, inverse), tuple(at)))


def transpose(x: Expr, axes: Sequence[int]) -> Expr:
    """``x.transpose(axes)``: a dimension permutation (``(1, 0)`` for a PyTorch Linear)."""
    axes = tuple(int(a) for a in axes)
    if sorted(axes) != list(range(len(x.shape))):
        raise ValueError(f"transpose axes {axes} are not a permutation of {len(x.shape)} dims")
    return _Transpose(x, axes)


@dataclass(frozen=True)
class _Reshape(Expr):
    x: Expr
    shape: tuple[int, ...]

    @property
    def dtype(self) -> np.dtype:  # type: ignore[override]
        return self.x.dtype

    @property
    def kept(self) -> int:
        """Leading dimensions the reshape leaves alone: blocks of them are read as blocks."""
        k = 0
        while k < min(len(self.shape), len(self.x.shape)) and self.shape[k] == self.x.shape[k]:
            k += 1
        # the rest must still match in size, so reshaping the kept block is well defined
        return k if math.prod(self.shape[k:]) == math.prod(self.x.shape[k:]) else 0

    def read(self, index: Index, tensors: Tensors) -> np.ndarray:
        # The dimensions it changes are read whole (a block of a merged dimension is not a
        # block of the source): at most this one tensor on the host.
        k = self.kept
        block = self.x.read(index[:k] + full_index(self.x.shape[k:]), tensors)
        whole = block.reshape(_lengths(index[:k]) + self.shape[k:])
        return whole[(slice(None),) * k + index[k:]]

    def leaves(self) -> Iterator[Tensor]:
        return self.x.leaves()

    def invert(self, piece: Piece) -> Iterator[tuple[str, Piece]]:
        k = self.kept
        if any(piece.at[k:]) or piece.value.shape[k:] != self.shape[k:]:
            raise ValueError(f"a reshape to {self.shape} cannot be inverted from a partial block")
        value = _Reshape(piece.value, piece.value.shape[:k] + self.x.shape[k:])
        return self.x.invert(Piece(value, piece.at[:k] + (0,) * (len(self.x.shape) - k)))


def reshape(x: Expr, shape: Sequence[int]) -> Expr:
    """``x.reshape(shape)``; the leading dimensions it keeps are read block by block."""
    shape = tuple(int(n) for n in shape)
    if math.prod(shape) != math.prod(x.shape):
        raise ValueError(f"cannot reshape {x.shape} to {shape}")
    return _Reshape(x, shape)


@dataclass(frozen=True)
class _Slice(Expr):
    x: Expr
    axis: int
    start: int
    stop: int

    @property
    def shape(self) -> tuple[int, ...]:  # type: ignore[override]
        s = list(self.x.shape)
        s[self.axis] = self.stop - self.start
        return tuple(s)

    @property
    def dtype(self) -> np.dtype:  # type: ignore[override]
        return self.x.dtype

    def read(self, index: Index, tensors: Tensors) -> np.ndarray:
        s = index[self.axis]
        return self.x.read(
            _replace(index, self.axis, slice(s.start + self.start, s.stop + self.start)), tensors
        )

    def leaves(self) -> Iterator[Tensor]:
        return self.x.leaves()

    def invert(self, piece: Piece) -> Iterator[tuple[str, Piece]]:
        at = list(piece.at)
        at[self.axis] += self.start
        return self.x.invert(Piece(piece.value, tuple(at)))


def split(x: Expr, axis: int, parts: int, index: int) -> Expr:
    """Part ``index`` of ``parts`` equal parts of ``x`` along ``axis`` (a fused QKV's q is
    ``split(qkv, axis=1, parts=3, index=0)``)."""
    n = x.shape[axis]
    if n % parts or not 0 <= index < parts:
        raise ValueError(f"cannot take part {index} of {parts} of dimension {axis} of {x.shape}")
    size = n // parts
    return _Slice(x, axis, index * size, (index + 1) * size)


@dataclass(frozen=True)
class _Take(Expr):
    x: Expr
    axis: int
    i: int

    @property
    def shape(self) -> tuple[int, ...]:  # type: ignore[override]
        return self.x.shape[: self.axis] + self.x.shape[self.axis + 1 :]

    @property
    def dtype(self) -> np.dtype:  # type: ignore[override]
        return self.x.dtype

    def read(self, index: Index, tensors: Tensors) -> np.ndarray:
        full = index[: self.axis] + (slice(self.i, self.i + 1),) + index[self.axis :]
        return self.x.read(full, tensors).squeeze(self.axis)

    def leaves(self) -> Iterator[Tensor]:
        return self.x.leaves()

    def invert(self, piece: Piece) -> Iterator[tuple[str, Piece]]:
        at = piece.at[: self.axis] + (self.i,) + piece.at[self.axis :]
        return self.x.invert(Piece(_ExpandDims(piece.value, self.axis), at))


def take(x: Expr, axis: int, i: int) -> Expr:
    """``x`` at position ``i`` of ``axis``, that dimension dropped (one layer of a stack)."""
    if not 0 <= i < x.shape[axis]:
        raise ValueError(f"index {i} is out of dimension {axis} of {x.shape}")
    return _Take(x, axis, i)


@dataclass(frozen=True)
class _ExpandDims(Expr):
    x: Expr
    axis: int

    @property
    def shape(self) -> tuple[int, ...]:  # type: ignore[override]
        return self.x.shape[: self.axis] + (1,) + self.x.shape[self.axis :]

    @property
    def dtype(self) -> np.dtype:  # type: ignore[override]
        return self.x.dtype

    def read(self, index: Index, tensors: Tensors) -> np.ndarray:
        inner = self.x.read(index[: self.axis] + index[self.axis + 1 :], tensors)
        block = np.expand_dims(inner, self.axis)
        return block[_replace(full_index(block.shape), self.axis, index[self.axis])]

    def leaves(self) -> Iterator[Tensor]:
        return self.x.leaves()

    def invert(self, piece: Piece) -> Iterator[tuple[str, Piece]]:
        at = piece.at[: self.axis] + piece.at[self.axis + 1 :]
        return self.x.invert(Piece(_Take(piece.value, self.axis, 0), at))


@dataclass(frozen=True)
class Concat(Expr):
    """Arrays joined along ``axis``; ``stack`` is a concatenation of expanded members."""

    xs: tuple[Expr, ...]
    axis: int

    @property
    def shape(self) -> tuple[int, ...]:  # type: ignore[override]
        s = list(self.xs[0].shape)
        s[self.axis] = sum(x.shape[self.axis] for x in self.xs)
        return tuple(s)

    @property
    def dtype(self) -> np.dtype:  # type: ignore[override]
        return self.xs[0].dtype

    def _members(self, lo: int, hi: int) -> Iterator[tuple[Expr, int, int, int]]:
        """Members overlapping ``[lo, hi)``: ``(member, its offset, overlap start, stop)``."""
        offset = 0
        for x in self.xs:
            n = x.shape[self.axis]
            start, stop = max(lo, offset), min(hi, offset + n)
            if start < stop:
                yield x, offset, start, stop
            offset += n

    def read(self, index: Index, tensors: Tensors) -> np.ndarray:
        s = index[self.axis]
        blocks = [
            x.read(_replace(index, self.axis, slice(start - offset, stop - offset)), tensors)
            for x, offset, start, stop in self._members(s.start, s.stop)
        ]
        if not blocks:
            return np.empty(_lengths(index), self.dtype)
        return np.concatenate(blocks, axis=self.axis)

    def leaves(self) -> Iterator[Tensor]:
        for x in self.xs:
            yield from x.leaves()

    def invert(self, piece: Piece) -> Iterator[tuple[str, Piece]]:
        lo = piece.at[self.axis]
        for x, offset, start, stop in self._members(lo, lo + piece.value.shape[self.axis]):
            value = _Slice(piece.value, self.axis, start - lo, stop - lo)
            at = list(piece.at)
            at[self.axis] = start - offset
            yield from x.invert(Piece(value, tuple(at)))


def concat(xs: Sequence[Expr], axis: int) -> Expr:
    """``np.concatenate(xs, axis)``: separate q, k, v tensors into one fused kernel."""
    xs = tuple(xs)
    rest = {(x.shape[:axis] + x.shape[axis + 1 :], x.dtype) for x in xs}
    if not xs or len(rest) != 1:
        raise ValueError(f"cannot concatenate {[(x.shape, str(x.dtype)) for x in xs]}")
    return Concat(xs, axis)


def stack(xs: Sequence[Expr], axis: int = 0) -> Expr:
    """``np.stack(xs, axis)``: per-layer tensors as one scanned stack."""
    xs = tuple(xs)
    if not xs or len({(x.shape, x.dtype) for x in xs}) != 1:
        raise ValueError(f"cannot stack {[(x.shape, str(x.dtype)) for x in xs]}")
    return Concat(tuple(_ExpandDims(x, axis) for x in xs), axis)


@dataclass(frozen=True)
class _Pad(Expr):
    x: Expr
    axis: int
    size: int
    value: float

    @property
    def shape(self) -> tuple[int, ...]:  # type: ignore[override]
        s = list(self.x.shape)
        s[self.axis] = self.size
        return tuple(s)

    @property
    def dtype(self) -> np.dtype:  # type: ignore[override]
        return self.x.dtype

    def read(self, index: Index, tensors: Tensors) -> np.ndarray:
        out = np.full(_lengths(index), self.value, self.dtype)
        s = index[self.axis]
        stop = min(s.stop, self.x.shape[self.axis])
        if s.start < stop:
            inner = self.x.read(_replace(index, self.axis, slice(s.start, stop)), tensors)
            out[_replace(full_index(out.shape), self.axis, slice(0, stop - s.start))] = inner
        return out

    def leaves(self) -> Iterator[Tensor]:
        return self.x.leaves()

    def invert(self, piece: Piece) -> Iterator[tuple[str, Piece]]:
        lo = piece.at[self.axis]
        stop = min(lo + piece.value.shape[self.axis], self.x.shape[self.axis])
        if lo < stop:  # the padding itself goes nowhere
            yield from self.x.invert(Piece(_Slice(piece.value, self.axis, 0, stop - lo), piece.at))


def pad(x: Expr, axis: int, size: int, value: float = 0.0) -> Expr:
    """``x`` grown to ``size`` along ``axis`` with ``value`` (a vocabulary padded to split
    over a model axis); export crops it back."""
    if size < x.shape[axis]:
        raise ValueError(f"cannot pad dimension {axis} of {x.shape} down to {size}")
    return _Pad(x, axis, int(size), value)


@dataclass(frozen=True)
class _Cast(Expr):
    x: Expr
    dtype: np.dtype

    @property
    def shape(self) -> tuple[int, ...]:  # type: ignore[override]
        return self.x.shape

    def read(self, index: Index, tensors: Tensors) -> np.ndarray:
        return self.x.read(index, tensors).astype(self.dtype)

    def leaves(self) -> Iterator[Tensor]:
        return self.x.leaves()

    def invert(self, piece: Piece) -> Iterator[tuple[str, Piece]]:
        return self.x.invert(Piece(_Cast(piece.value, self.x.dtype), piece.at))


def cast(x: Expr, dtype: Any) -> Expr:
    """``x.astype(dtype)``: a file's float16 into float32 parameters, said explicitly."""
    return _Cast(x, np.dtype(dtype))
