"""Where pretrained tensors come from: safetensors files, a NumPy tree, a plain Orbax export.

A source says what it holds (``tensors()``: name -> shape and dtype), what is
wrong with it (``problems()``, found when it was opened, before anything is
read) and gives each tensor as an array-like that reads only the block asked
for (``source[name][index]``).
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from nnx_spmd_trainer.sharding import path_str
from nnx_spmd_trainer.weights.safetensors_files import (
    SafetensorsFiles,
    find_files,
    index_problems,
    vet_header,
)

__all__ = [
    "SAFETENSORS_DTYPES",
    "OrbaxSource",
    "SafetensorsSource",
    "TensorInfo",
    "TreeSource",
    "WeightSource",
]

#: safetensors' dtype names and their NumPy dtypes (little-endian on disk).
SAFETENSORS_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(jnp.bfloat16),
    "F8_E4M3": np.dtype(jnp.float8_e4m3fn),
    "F8_E5M2": np.dtype(jnp.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}


@dataclass(frozen=True)
class TensorInfo:
    """A tensor's shape and dtype, as its source records them."""

    shape: tuple[int, ...]
    dtype: np.dtype


class WeightSource(Protocol):
    """What ``load_weights`` reads: names, shapes and dtypes, damage, and lazy tensors."""

    def tensors(self) -> Mapping[str, TensorInfo]: ...

    def problems(self) -> list[str]: ...

    def __getitem__(self, name: str) -> Any: ...


@dataclass(frozen=True)
class _Entry:
    file: Path
    info: TensorInfo
    offset: int  # from the start of the file


class SafetensorsSource:
    """One or more ``.safetensors`` files (a file, a list, or a directory of them), memory
    mapped: a tensor's block is read from the pages it lies on, nothing else.

    The header is parsed here (8 bytes of length, then JSON), so a file cut short, a
    tensor whose bytes run past its end or do not match its shape, an unknown dtype and a
    name in two files are ``problems()`` before any tensor is read; a header that reads
    well is then vetted by the ``safetensors`` package itself (``safe_open``), which
    refuses tensors whose bytes overlap and bytes that belong to no tensor. A sharded
    Hugging Face checkpoint (``model-00001-of-00002.safetensors``, ...) is a directory of
    them; where it holds ``model.safetensors.index.json``, exactly the files the index
    names are read (not a consolidated ``model.safetensors`` beside them), and a tensor
    the index lists that its file lacks is a problem too. The index's own path works too.

    >>> import tempfile, numpy as np, safetensors.numpy
    >>> path = tempfile.mkdtemp() + "/w.safetensors"
    >>> wpe = np.arange(6, dtype=np.float32).reshape(3, 2)
    >>> safetensors.numpy.save_file({"wpe.weight": wpe}, path)
    >>> source = SafetensorsSource(path)
    >>> source.tensors()["wpe.weight"]
    TensorInfo(shape=(3, 2), dtype=dtype('float32'))
    >>> source["wpe.weight"][1:, :1]
    array([[2.],
           [4.]], dtype=float32)
    """

    def __init__(self, path: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]) -> None:
        found = (
            find_files(Path(path))
            if isinstance(path, str | os.PathLike)
            else SafetensorsFiles([Path(p) for p in path])
        )
        files = found.files
        self._entries: dict[str, _Entry] = {}
        self._problems: list[str] = list(found.problems)
        self._maps: dict[Path, mmap.mmap] = {}
        self._files = files
        absent = [str(file) for file in files if not file.exists()]
        if absent:  # a wrong path, not a damaged file: no list of every tensor it lacks
            raise FileNotFoundError(
                f"no weights file at {', '.join(absent)}: give the path of a .safetensors "
                "file, a list of them, or a directory holding them."
            )
        if not files and found.index is None:
            self._problems.append(f"{path}: no .safetensors file there")
        for file in files:
            self._read_header(file)
        holders = {name: entry.file for name, entry in self._entries.items()}
        self._problems += index_problems(found, holders)

    def _read_header(self, file: Path) -> None:
        try:
            size = file.stat().st_size
            with open(file, "rb") as f:
                head = f.read(8)
                (length,) = struct.unpack("<Q", head) if len(head) == 8 else (None,)
                if length is None or 8 + length > size:
                    self._problems.append(f"{file}: truncated ({size} bytes, inside its header)")
                    return
                header = json.loads(f.read(length))
        except (OSError, ValueError) as error:
            self._problems.append(f"{file}: unreadable header ({error})")
            return
        before = len(self._problems)
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            problem = self._add(file, name, entry, 8 + length, size)
            if problem:
                self._problems.append(f"{file}: {name}: {problem}")
        if len(self._problems) == before:  # damage named above is not named twice
            damage = vet_header(file, header, size - 8 - length)
            if damage:
                self._problems.append(f"{file}: {damage}")

    def _add(self, file: Path, name: str, entry: Any, data_start: int, size: int) -> str | None:
        try:
            dtype, shape = SAFETENSORS_DTYPES.get(entry["dtype"]), tuple(entry["shape"])
            begin, end = entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            return f"malformed header entry {entry!r}"
        if not all(isinstance(n, int) and n >= 0 for n in (begin, end, *shape)):
            return f"malformed header entry {entry!r}"
        if dtype is None:
            return f"unsupported dtype {entry['dtype']}"
        if end - begin != math.prod(shape) * dtype.itemsize:
            return f"{end - begin} bytes for shape {shape} of {entry['dtype']}"
        if data_start + end > size:
            return f"truncated: its bytes end at {data_start + end}, the file has {size}"
        if name in self._entries:
            return f"also in {self._entries[name].file}"
        self._entries[name] = _Entry(file, TensorInfo(shape, dtype), data_start + begin)
        return None

    def __repr__(self) -> str:
        return f"SafetensorsSource({', '.join(str(f) for f in self._files)})"

    def tensors(self) -> dict[str, TensorInfo]:
        return {name: entry.info for name, entry in self._entries.items()}

    def problems(self) -> list[str]:
        return list(self._problems)

    def __getitem__(self, name: str) -> np.ndarray:
        entry = self._entries[name]
        if entry.info.dtype.itemsize * math.prod(entry.info.shape) == 0:
            return np.empty(entry.info.shape, entry.info.dtype)
        if entry.file not in self._maps:
            with open(entry.file, "rb") as f:
                self._maps[entry.file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        # A read-only view of the mapped pages: slicing it copies only the block's pages.
        return np.ndarray(
            entry.info.shape, entry.info.dtype, buffer=self._maps[entry.file], offset=entry.offset
        )


class TreeSource:
    """Arrays already on the host: a nested dict (names ``"h/0/attn/kernel"``, as
    ``path_str`` writes them) or a flat ``{name: array}`` dict.

    >>> import numpy as np
    >>> TreeSource({"wte": {"embedding": np.zeros((4, 2), np.float32)}}).tensors()
    {'wte/embedding': TensorInfo(shape=(4, 2), dtype=dtype('float32'))}
    """

    def __init__(self, tree: Mapping[str, Any]) -> None:
        leaves = jax.tree_util.tree_flatten_with_path(dict(tree))[0]
        self._arrays = {path_str(p): leaf for p, leaf in leaves}

    def tensors(self) -> dict[str, TensorInfo]:
        return {
            name: TensorInfo(tuple(a.shape), np.dtype(a.dtype)) for name, a in self._arrays.items()
        }

    def problems(self) -> list[str]:
        return []

    def __getitem__(self, name: str) -> Any:
        return self._arrays[name]


class OrbaxSource:
    """A plain Orbax checkpoint of NumPy arrays (``export_params``'s output), read one
    tensor at a time (a partial restore), the last one kept for the next device's block.

    Names are ``path_str`` names (``"blocks/0/linear1/kernel"``). A damaged file is
    found when its tensor is read, not when the source is opened (Orbax reads no
    checksum and records no sizes to compare).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        import orbax.checkpoint as ocp  # here: the library does not import Orbax on import

        self._path = Path(path).absolute()
        self._ocp = ocp
        metadata: Any = ocp.PyTreeCheckpointer().metadata(self._path)
        tree = getattr(metadata, "item_metadata", metadata)
        tree = getattr(tree, "tree", tree)
        self._keys: dict[str, tuple[Any, ...]] = {}
        self._infos: dict[str, TensorInfo] = {}
        for p, m in jax.tree_util.tree_flatten_with_path(tree)[0]:
            name = path_str(p)
            self._keys[name] = tuple(getattr(k, "key", k) for k in p)
            self._infos[name] = TensorInfo(tuple(m.shape), np.dtype(m.dtype))
        self._last: tuple[str, np.ndarray] | None = None

    def __repr__(self) -> str:
        return f"OrbaxSource({self._path})"

    def tensors(self) -> dict[str, TensorInfo]:
        return dict(self._infos)

    def problems(self) -> list[str]:
        return []

    def __getitem__(self, name: str) -> np.ndarray:
        if self._last is None or self._last[0] != name:
            self._last = None  # let the previous tensor go before reading the next
            item: Any = np.zeros(0)
            restore: Any = self._ocp.RestoreArgs(restore_type=np.ndarray)
            for key in reversed(self._keys[name]):
                item, restore = {key: item}, {key: restore}
            args = self._ocp.args.PyTreeRestore(
                item=item, restore_args=restore, partial_restore=True
            )
            tree = self._ocp.PyTreeCheckpointer().restore(self._path, args=args)
            for key in self._keys[name]:
                tree = tree[key]
            self._last = (name, np.asarray(tree))
        return self._last[1]
