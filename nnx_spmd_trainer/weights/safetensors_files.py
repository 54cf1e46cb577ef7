"""Which ``.safetensors`` files a path means, and whether safetensors itself accepts each.

A directory holding ``model.safetensors.index.json`` (Hugging Face's sharded layout) is
read through its index: exactly the files it names, so a repository that also keeps the
consolidated ``model.safetensors`` beside its shards loads each tensor once. Without an
index, a directory is every ``*.safetensors`` in it.

``vet_header`` asks the ``safetensors`` package (``safe_open``) for its verdict on a
file's header, which refuses what a reader of the header alone would accept: tensors
whose bytes overlap, and bytes that belong to no tensor.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import safetensors

__all__ = ["INDEX", "SafetensorsFiles", "find_files", "index_problems", "vet_header"]

#: Hugging Face's index of a sharded checkpoint: ``{"weight_map": {tensor: file}}``.
INDEX = "model.safetensors.index.json"

_FIX = "the file is damaged: download or export it again"


@dataclass
class SafetensorsFiles:
    """The files to read, and what an index promises about them."""

    files: list[Path]
    #: the index the files came from, or ``None`` (a file, a list, a directory without one)
    index: Path | None = None
    #: tensor name -> the file the index says holds it
    listed: dict[str, Path] = field(default_factory=dict)
    #: what is wrong with the index itself (unreadable, naming a file that is not there)
    problems: list[str] = field(default_factory=list)


def find_files(path: Path) -> SafetensorsFiles:
    """The files ``path`` means: the files an index names (``path`` is the index, or a
    directory holding ``model.safetensors.index.json``), every ``*.safetensors`` of a
    directory without one, or the file itself."""
    if path.is_dir() and (path / INDEX).is_file():
        return _read_index(path / INDEX)
    if path.is_file() and path.name.endswith(".safetensors.index.json"):
        return _read_index(path)
    return SafetensorsFiles(sorted(path.glob("*.safetensors")) if path.is_dir() else [path])


def _read_index(index: Path) -> SafetensorsFiles:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        listed = {str(name): index.parent / str(file) for name, file in weight_map.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        problem = f"{index}: unreadable index ({error!r}); {_FIX}"
        return SafetensorsFiles([], index, problems=[problem])
    files = sorted(set(listed.values()))
    absent = [file for file in files if not file.is_file()]
    problems = [
        f"{index} names {file.name}, which is not there: download the checkpoint's every shard"
        for file in absent
    ]
    present = [file for file in files if file not in absent]
    return SafetensorsFiles(present, index, listed, problems)


def index_problems(found: SafetensorsFiles, holders: Mapping[str, Path]) -> list[str]:
    """Each tensor the index lists that its file does not hold (``holders``: tensor name ->
    the file it was found in); tensors of a shard already named as absent are not repeated."""
    problems = []
    for name, file in sorted(found.listed.items()):
        if file not in found.files:
            continue
        if name not in holders:
            problems.append(f"{found.index}: {name}: listed in {file.name}, which lacks it; {_FIX}")
        elif holders[name] != file:
            problems.append(
                f"{found.index}: {name}: listed in {file.name}, found in {holders[name].name}; "
                f"{_FIX}"
            )
    return problems


def vet_header(file: Path, header: Mapping[str, Any], data_size: int) -> str | None:
    """``None`` where ``safetensors.safe_open`` opens ``file``; else the damage: the tensors
    whose bytes overlap another's and the bytes that belong to no tensor, where the
    header shows them, then safetensors' own words and the fix.

    Args:
      file: the ``.safetensors`` file.
      header: its parsed header, every entry's ``data_offsets`` already checked as a pair of
        integers (the caller's reader does).
      data_size: the bytes after the header.
    """
    try:
        with safetensors.safe_open(str(file), "numpy"):
            return None
    except (safetensors.SafetensorError, OSError) as error:
        verdict = str(error)
    where = _misplaced_bytes(header, data_size)
    return f"{where + ': ' if where else ''}safetensors refuses the file ({verdict}); {_FIX}"


def _misplaced_bytes(header: Mapping[str, Any], data_size: int, shown: int = 3) -> str:
    """The tensors whose bytes overlap another's, then the bytes that belong to no tensor
    (where a moved tensor's bytes were), walking the tensors in the order of their bytes."""
    spans = sorted(
        (*entry["data_offsets"], name) for name, entry in header.items() if name != "__metadata__"
    )
    overlaps, gaps = [], []
    at, previous = 0, None
    for begin, end, name in spans:
        if begin < at:
            overlaps.append(f"{name}: its bytes {begin}-{end} overlap {previous}'s, up to {at}")
        elif begin > at:
            gaps.append(f"bytes {at}-{begin} before {name} belong to no tensor")
        if end >= at:
            at, previous = end, name
    if at < data_size:
        gaps.append(f"bytes {at}-{data_size} after {previous} belong to no tensor")
    found = overlaps + gaps
    more = f"; and {len(found) - shown} more" if len(found) > shown else ""
    return "; ".join(found[:shown]) + more
