"""What a corpus is written from: the input files (a folder stands for its files), each
text file one document, each non-blank line of a ``.jsonl`` one (its field); and the
error every corpus problem raises (``CorpusError``, re-exported by ``data.corpus``).

A file that is not UTF-8 text (a binary file among the texts) is named with the byte
and offset that give it away: ``text_files`` sorts such files out before a write,
``documents`` refuses one met while writing.
"""

from __future__ import annotations

import codecs
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

__all__ = ["CorpusError", "count_documents", "expand_inputs", "read_documents", "text_files"]

_SNIFF_BYTES = 1 << 20  # read at a time when checking a file is UTF-8 text


class CorpusError(ValueError):
    """A corpus that is damaged, incomplete, or does not fit the model or tokenizer."""


def read_documents(
    files: list[str], field: str, start: list[int]
) -> Iterator[tuple[str, list[int]]]:
    """Each document's text from ``start`` (``[file index, byte offset]``) on, with where
    the next document starts: a whole file, or the ``field`` of each line of a ``.jsonl``."""
    for index in range(start[0], len(files)):
        path = Path(files[index])
        if path.suffix != ".jsonl":
            yield _utf8(path, path.read_bytes()), [index + 1, 0]
            continue
        offset = start[1] if index == start[0] else 0
        with path.open("rb") as lines:
            lines.seek(offset)  # a resumed write goes straight to its next document
            for line in lines:
                at, offset = offset, offset + len(line)
                if not line.strip():
                    continue
                try:
                    record = json.loads(_utf8(path, line, at))
                except json.JSONDecodeError as error:
                    raise CorpusError(f"{path} at byte {at}: not a JSON line ({error}).") from None
                if field not in record:
                    raise CorpusError(f"{path} at byte {at}: no field {field!r} to tokenize.")
                yield str(record[field]), [index, offset]


def _utf8(path: Path, data: bytes, at: int = 0) -> str:
    """``data`` (read from ``path`` at byte ``at``) as text, or a ``CorpusError`` naming
    the file: a binary file among the texts is the usual cause."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise CorpusError(
            f"{path} is not UTF-8 text (byte {data[error.start]:#04x} at offset "
            f"{at + error.start}): a binary file? Leave it out of the inputs."
        ) from None


def count_documents(files: Sequence[str | os.PathLike[str]]) -> int:
    """The documents in ``files``: one a text file, one a non-blank line of a ``.jsonl``
    (read as bytes: a quick pass, for a progress bar's total)."""
    count = 0
    for path in map(Path, files):
        if path.suffix != ".jsonl":
            count += 1
            continue
        with path.open("rb") as lines:
            count += sum(1 for line in lines if line.strip())
    return count


def expand_inputs(inputs: Sequence[str | os.PathLike[str]]) -> list[str]:
    """The input files in writing order: a folder stands for its files, sorted."""
    files: list[str] = []
    for item in map(Path, inputs):
        found = sorted(p for p in item.rglob("*") if p.is_file()) if item.is_dir() else [item]
        files += [os.fspath(p) for p in found]
    return files


def _not_utf8(path: Path) -> str | None:
    """Why ``path`` is not UTF-8 text (the byte and its offset), or ``None`` if it is."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with path.open("rb") as file:
        while True:
            data = file.read(_SNIFF_BYTES)
            try:
                decoder.decode(data, final=not data)
            except UnicodeDecodeError as error:
                at = offset + error.start - len(decoder.getstate()[0])
                return f"byte {error.object[error.start]:#04x} at offset {max(at, 0)}"
            if not data:
                return None
            offset += len(data)


def text_files(files: Sequence[str | os.PathLike[str]]) -> tuple[list[str], list[tuple[str, str]]]:
    """``files`` split into the UTF-8 text ones and the others, each with why (reads every
    file once, in pieces: for skipping binary files before a tokenizer is trained on them)."""
    texts: list[str] = []
    skipped: list[tuple[str, str]] = []
    for name in (os.fspath(file) for file in files):
        why = _not_utf8(Path(name))
        if why is None:
            texts.append(name)
        else:
            skipped.append((name, why))
    return texts, skipped
