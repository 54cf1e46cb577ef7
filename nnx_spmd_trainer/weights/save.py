"""Weights out: a model's parameters written as a safetensors file through a WeightMap
read backwards, one file tensor at a time.

Each file tensor is rebuilt on the host from the blocks of the model arrays that
feed it (``Expr.invert``), read from the devices' shards, written, and dropped
before the next: the host holds one file tensor (and one gathered model array
with several processes), never the model.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from nnx_spmd_trainer.data.to_host import gather_to_host
from nnx_spmd_trainer.sharding import path_str
from nnx_spmd_trainer.weights.expr import Piece, Tensor, full_index
from nnx_spmd_trainer.weights.mapping import WeightMap, WeightsMismatch, check
from nnx_spmd_trainer.weights.sources import SAFETENSORS_DTYPES

__all__ = ["save_safetensors"]

_CODES = {dtype: code for code, dtype in SAFETENSORS_DTYPES.items()}


class _DeviceArrays:
    """Model arrays by path; ``[path][index]`` copies just that block to the host."""

    def __init__(self, arrays: dict[str, Any]) -> None:
        self.arrays = arrays
        self._gathered: tuple[str, np.ndarray] | None = None

    def __getitem__(self, path: str) -> _Blocks:
        return _Blocks(self, path)

    def block(self, path: str, index: tuple[slice, ...]) -> np.ndarray:
        x = self.arrays[path]
        if not isinstance(x, jax.Array):
            return np.asarray(x[index])
        if not x.is_fully_addressable:
            # Several processes: every one gathers the same arrays in the same order (a
            # collective); the last is kept, as the next file tensor often reads it too.
            if self._gathered is None or self._gathered[0] != path:
                self._gathered = None
                self._gathered = (path, gather_to_host(x))
            return self._gathered[1][index]
        out = np.empty(tuple(s.stop - s.start for s in index), x.dtype)
        done: set[tuple[tuple[int, int], ...]] = set()
        for shard in x.addressable_shards:  # each distinct shard overlapping the block, once
            held = tuple(s.indices(n)[:2] for s, n in zip(shard.index, x.shape, strict=True))
            lo = [max(a, s.start) for (a, _), s in zip(held, index, strict=True)]
            hi = [min(b, s.stop) for (_, b), s in zip(held, index, strict=True)]
            if held in done or any(a >= b for a, b in zip(lo, hi, strict=True)):
                continue
            done.add(held)
            data = np.asarray(shard.data)
            src = tuple(slice(a - h[0], b - h[0]) for a, b, h in zip(lo, hi, held, strict=True))
            dst = tuple(
                slice(a - s.start, b - s.start) for a, b, s in zip(lo, hi, index, strict=True)
            )
            out[dst] = data[src]
        return out


class _Blocks:
    def __init__(self, arrays: _DeviceArrays, path: str) -> None:
        self.arrays, self.path = arrays, path

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        return self.arrays.block(self.path, index)


def _pieces(weight_map: WeightMap, arrays: dict[str, Any]) -> dict[str, list[Piece]]:
    """For each file tensor, the blocks of model arrays that rebuild it."""
    out: dict[str, list[Piece]] = {}
    for path, expr in weight_map.targets.items():
        x = arrays[path]
        whole = Piece(Tensor(path, tuple(x.shape), np.dtype(x.dtype)), (0,) * len(x.shape))
        for name, piece in expr.invert(whole):
            out.setdefault(name, []).append(piece)
    return out


def _box(piece: Piece) -> tuple[tuple[int, int], ...]:
    return tuple((a, a + n) for a, n in zip(piece.at, piece.value.shape, strict=True))


def _covers(declared: Tensor, pieces: list[Piece]) -> list[Piece] | str:
    """The distinct pieces, if they tile ``declared`` exactly; else what is wrong."""
    boxes: dict[tuple[tuple[int, int], ...], Piece] = {}
    for piece in pieces:  # one tensor read twice (tied weights) gives the same block twice
        boxes.setdefault(_box(piece), piece)
    for i, a in enumerate(boxes):
        for b in list(boxes)[i + 1 :]:
            if all(max(x[0], y[0]) < min(x[1], y[1]) for x, y in zip(a, b, strict=True)):
                return f"blocks {a} and {b} overlap"
    covered = sum(math.prod(hi - lo for lo, hi in box) for box in boxes)
    if covered != math.prod(declared.shape):
        return f"the model fills {covered} of its {math.prod(declared.shape)} elements"
    return list(boxes.values())


def _header(tensors: list[Tensor], metadata: dict[str, str]) -> bytes:
    entries: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for t in tensors:
        size = math.prod(t.shape) * t.dtype.itemsize
        entries[t.name] = {
            "dtype": _CODES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data to 8 bytes
    return len(raw).to_bytes(8, "little") + raw


def _model_arrays(params: nnx.Module | nnx.State | dict[str, Any]) -> dict[str, Any]:
    if isinstance(params, nnx.Module):
        params = nnx.state(params, nnx.Param)
    return {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


def save_safetensors(
    params: nnx.Module | nnx.State | dict[str, Any],
    path: str | os.PathLike[str],
    weight_map: WeightMap,
    *,
    metadata: dict[str, str] | None = None,
    overwrite: bool = False,
) -> Path:
    """Writes the file ``weight_map`` describes from a model's parameters.

    Args:
      params: a model (its ``nnx.Param`` leaves), or a state or nested dict of its
        parameter arrays (sharded ``jax.Array`` s or NumPy).
      path: the ``.safetensors`` file to write.
      weight_map: the map ``load_weights`` reads; every tensor it declares is
        written, under its declared name, shape and dtype (padding cropped, stacks
        split, fused parts joined).
      metadata: the header's ``__metadata__``; default ``{"format": "pt"}``, which
        Hugging Face's loaders expect.
      overwrite: replace an existing file.

    The file's directory is made where it is missing.

    With several processes every process must call it (the arrays a process
    cannot address are gathered, a collective); process 0 writes. The file is
    written beside ``path`` and renamed, so a crash leaves no partial file.
    ``safetensors.numpy.load_file(path)`` reads it alone.

    Raises:
      WeightsMismatch: before anything is written, when the map does not fit the
        model or a declared tensor is not rebuilt whole from it.
    """
    path = Path(path).absolute()
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists: pass overwrite=True to replace it.")
    arrays = _model_arrays(params)
    problems = check(
        weight_map, {p: jax.ShapeDtypeStruct(x.shape, x.dtype) for p, x in arrays.items()}
    )
    declared = weight_map.sources()
    pieces = _pieces(weight_map, arrays) if not problems else {}
    tiles: dict[str, list[Piece]] = {}
    for name, tensor in declared.items() if not problems else ():
        covered = _covers(tensor, pieces.get(name, []))
        if isinstance(covered, str):
            problems.setdefault("map", []).append(f"{name} cannot be rebuilt: {covered}")
        else:
            tiles[name] = covered
    if problems:
        raise WeightsMismatch(problems, where=f"the export to {path}")

    order = sorted(declared.values(), key=lambda t: t.name)
    reader = _DeviceArrays(arrays)
    writer = jax.process_index() == 0
    if writer:
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    failed: OSError | None = None  # a full disk: no partial file is left behind
    try:
        with open(tmp, "wb") if writer else open(os.devnull, "wb") as f:
            f.write(_header(order, metadata if metadata is not None else {"format": "pt"}))
            for data in _rebuilt(order, tiles, reader):  # several processes: a collective
                if failed is None:  # each; after a failed write, only read on in step
                    try:
                        f.write(np.ascontiguousarray(data).data)  # little-endian: the file's
                    except OSError as error:
                        failed = error
    except OSError as error:  # the header's write, or the close's flush
        failed = failed or error
    if failed is not None:
        if writer:
            tmp.unlink(missing_ok=True)
        raise failed
    if writer:
        os.replace(tmp, path)
    return path


def _rebuilt(
    order: list[Tensor], tiles: dict[str, list[Piece]], reader: _DeviceArrays
) -> Iterator[np.ndarray]:
    for tensor in order:
        out = np.empty(tensor.shape, tensor.dtype)
        for piece in tiles[tensor.name]:
            box = tuple(slice(lo, hi) for lo, hi in _box(piece))
            out[box] = piece.value.read(full_index(piece.value.shape), reader)
        yield out
