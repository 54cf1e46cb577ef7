"""A tokenized corpus on disk: ``write_corpus`` makes one, ``Corpus`` reads it per process.

The format is a memory-mapped flat token array with document offsets, chosen
over ArrayRecord (``grain.sources.ArrayRecordDataSource``) for four reasons
(docs/topics/corpora.md has the measurements):

- **Random access for shuffling.** Document ``i`` is ``tokens[ends[i-1]:ends[i]]``:
  one slice of a memory map, no index lookup, no record decoding; Grain's global
  shuffle asks for documents in any order and each costs the same.
- **Read speed per process.** A read copies the pages it touches (the OS page
  cache and read-ahead do the rest): 14 us a 300-byte document here, against
  89 us a 200-byte ArrayRecord record written for random access (``group_size:1``,
  which also made the file 36% larger than its records).
- **No process reads the whole corpus.** A process touches only the pages of the
  documents its shard asks for and of their offsets (8 bytes a document, also
  memory-mapped); the header is a few hundred bytes. ``Corpus.bytes_read`` counts
  the token bytes a process sliced.
- **Robust to a truncated file.** The header records how many bytes each file
  holds and ``chunks.bin`` a CRC32 of every chunk written, so a file cut short is
  named with its path and the offset where it ends when the corpus opens, before
  anything trains, and ``Corpus.verify`` names a damaged chunk. An ArrayRecord
  file cut in half fails to open as a whole, with a Riegeli hash mismatch.

Files in the corpus folder: ``tokens.bin`` (``uint16`` ids for a vocabulary of
up to 65536, else ``uint32``), ``offsets.bin`` (``int64``: the end of each
document in tokens), ``chunks.bin`` (``CHUNK_RECORD``s), ``header.json`` and
``tokenizer.json``.

The writer appends in chunks of documents: data first, then an atomic
replacement of the header that records it, so a stopped write leaves a header
naming only bytes that are on disk, and ``write_corpus`` run again continues
after the last complete chunk (bytes of a torn chunk are cut off first).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from nnx_spmd_trainer.data.corpus_inputs import (
    CorpusError,
    count_documents,
    expand_inputs,
    read_documents,
)
from nnx_spmd_trainer.data.reads import count_read
from nnx_spmd_trainer.data.tokenizer import TOKENIZER_FILE, Tokenizer, load_tokenizer

HEADER_FILE = "header.json"
#: The file of a corpus holding its token ids (all documents, end to end).
TOKENS_FILE = "tokens.bin"
OFFSETS_FILE = "offsets.bin"
CHUNKS_FILE = "chunks.bin"
FORMAT_VERSION = 1

#: One record of ``chunks.bin`` a chunk written: its documents, its tokens, and the CRC32
#: of its bytes in ``tokens.bin`` and in ``offsets.bin``.
CHUNK_RECORD = np.dtype(
    [("n_docs", "<i8"), ("n_tokens", "<i8"), ("tokens_crc32", "<u4"), ("offsets_crc32", "<u4")]
)


def token_dtype(vocab_size: int) -> np.dtype[Any]:
    """``uint16`` for vocabularies under 65536 ids, else ``uint32``."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def _write_header(directory: Path, header: dict[str, Any]) -> None:
    partial = directory / (HEADER_FILE + ".partial")
    with partial.open("w", encoding="utf-8") as file:
        json.dump(header, file, indent=1)
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, directory / HEADER_FILE)  # the header names only bytes on disk


def _append(path: Path, data: bytes) -> None:
    with path.open("ab") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def _file_sizes(header: dict[str, Any]) -> dict[str, int]:
    """The bytes of each data file that a header records."""
    return {
        TOKENS_FILE: header["n_tokens"] * np.dtype(header["dtype"]).itemsize,
        OFFSETS_FILE: header["n_docs"] * 8,
        CHUNKS_FILE: header["n_chunks"] * CHUNK_RECORD.itemsize,
    }


def _start_or_resume(out: Path, files: list[str], tokenizer: Tokenizer) -> dict[str, Any]:
    """The header to continue from: a new one, or the last one written, with any torn
    chunk's bytes cut off the data files."""
    inputs_sha256 = hashlib.sha256("\n".join(files).encode()).hexdigest()
    if not (out / HEADER_FILE).exists():
        for name in (TOKENS_FILE, OFFSETS_FILE, CHUNKS_FILE):
            (out / name).write_bytes(b"")
        return {
            "format": FORMAT_VERSION,
            "dtype": token_dtype(tokenizer.vocab_size).name,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
            "tokenizer_sha256": tokenizer.sha256,
            "n_inputs": len(files),
            "inputs_sha256": inputs_sha256,
            "n_docs": 0,
            "n_tokens": 0,
            "n_chunks": 0,
            "max_id": -1,
            "next_input": [0, 0],
            "complete": False,
        }
    header: dict[str, Any] = json.loads((out / HEADER_FILE).read_text(encoding="utf-8"))
    if header["tokenizer_sha256"] != tokenizer.sha256 or header["inputs_sha256"] != inputs_sha256:
        raise CorpusError(
            f"{out} holds a corpus of other inputs or another tokenizer; write to a new "
            "folder, or delete this one to start again."
        )
    for name, size in _file_sizes(header).items():
        with (out / name).open("r+b") as file:
            file.truncate(size)  # the bytes of a chunk stopped before its header was written
    return header


def write_corpus(
    inputs: Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    tokenizer: Tokenizer,
    *,
    jsonl_field: str = "text",
    append_eos: bool = True,
    chunk_docs: int = 1024,
    progress: bool = True,
) -> Corpus:
    """Tokenizes text files into a corpus at ``out_dir``; run again, it resumes.

    Args:
      inputs: text files (one document each), ``.jsonl`` files (one document per line,
        its ``jsonl_field``), or folders of them (their files in sorted order).
      out_dir: the corpus folder; the tokenizer is saved in it as ``tokenizer.json``.
      tokenizer: the ``Tokenizer`` (``train_bpe`` or ``load_tokenizer``).
      append_eos: end each document with ``tokenizer.eos_id``.
      chunk_docs: documents per chunk: the unit of a checksum and of resuming.
      progress: show a tqdm progress bar of documents (of the total it counts first).

    A bad input (a file that is not UTF-8 text, a JSON line without ``jsonl_field``) or
    inputs with no document raise ``CorpusError`` naming it; a corpus this call started
    is then removed, so nothing half-written is left (a stop, Ctrl-C, keeps what is
    written: the same call continues it).
    """
    out = Path(out_dir)
    if append_eos and tokenizer.eos_id is None:
        raise CorpusError("The tokenizer has no end-of-document token; pass append_eos=False.")
    files = expand_inputs(inputs)
    if not files:
        raise CorpusError(f"No input files in {[os.fspath(i) for i in inputs]}: nothing to write.")
    created = not out.exists()
    started = created or not (out / HEADER_FILE).exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        header = _start_or_resume(out, files, tokenizer)
        if not header["complete"]:
            tokenizer.save(out)
            texts = read_documents(files, jsonl_field, header["next_input"])
            total = count_documents(files) if progress else None
            _write_chunks(out, header, texts, tokenizer, append_eos, chunk_docs, progress, total)
        if header["n_docs"] == 0:
            raise CorpusError(
                f"The inputs hold no document (empty .jsonl files?): {files[:3]}; nothing to write."
            )
    except Exception:
        if started:  # nothing half-written: what this call began goes (a stop keeps it)
            _remove_written(out, remove_folder=created)
        raise
    return Corpus(out)


def _remove_written(out: Path, *, remove_folder: bool) -> None:
    """The files a corpus write makes, removed (and ``out`` itself where it made it)."""
    for name in (HEADER_FILE, HEADER_FILE + ".partial", TOKENS_FILE, OFFSETS_FILE, CHUNKS_FILE):
        (out / name).unlink(missing_ok=True)
    for name in (TOKENIZER_FILE, TOKENIZER_FILE + ".partial"):
        (out / name).unlink(missing_ok=True)
    if remove_folder:
        with contextlib.suppress(OSError):  # not empty: the user's own files stay
            out.rmdir()


def _write_chunks(
    out: Path,
    header: dict[str, Any],
    documents: Iterator[tuple[str, list[int]]],
    tokenizer: Tokenizer,
    append_eos: bool,
    chunk_docs: int,
    progress: bool,
    total: int | None = None,
) -> None:
    from tqdm import tqdm  # the writer's alone: not imported with the library

    dtype = np.dtype(header["dtype"])
    bar = tqdm(
        desc=f"tokenizing into {out}",
        unit="doc",
        total=total,
        initial=header["n_docs"],
        disable=not progress,
    )
    with bar:
        while True:
            taken = [doc for _, doc in zip(range(chunk_docs), documents, strict=False)]
            if not taken:
                break
            texts = [text for text, _ in taken]
            encoded = tokenizer.encode_batch(texts)
            if append_eos:
                eos = np.array([tokenizer.eos_id], np.int32)
                encoded = [np.concatenate([ids, eos]) for ids in encoded]
            tokens = np.concatenate(encoded).astype(dtype)
            ends = header["n_tokens"] + np.cumsum([len(ids) for ids in encoded], dtype=np.int64)
            record = np.array(
                [
                    (
                        len(texts),
                        len(tokens),
                        zlib.crc32(tokens.tobytes()),
                        zlib.crc32(ends.tobytes()),
                    )
                ],
                CHUNK_RECORD,
            )
            _append(out / TOKENS_FILE, tokens.tobytes())
            _append(out / OFFSETS_FILE, ends.tobytes())
            _append(out / CHUNKS_FILE, record.tobytes())
            header["n_chunks"] += 1
            header["next_input"] = taken[-1][1]
            header["n_docs"] += len(texts)
            header["n_tokens"] += len(tokens)
            header["max_id"] = max(header["max_id"], int(tokens.max(initial=0)))
            _write_header(out, header)
            bar.update(len(texts))
    header["complete"] = True
    _write_header(out, header)


class Corpus:
    """A tokenized corpus as a random-access Grain source: ``corpus[i]`` is document ``i``'s
    ids (``int32``), read from a memory map, so a process reads only the documents it is
    asked for.

    Opening checks the header against the files: a missing or truncated file raises
    ``CorpusError`` naming its path and the byte offset where it ends. ``check_vocab``
    refuses a corpus with ids beyond the model's vocabulary.

    Attributes:
      directory: the corpus folder.
      header: ``header.json``: dtype, vocab_size, n_docs, n_tokens, max_id, ...
      dtype: the ids' type on disk (``uint16`` or ``uint32``).
      bytes_read: token bytes this object has read (``read``): a process's share.
      vocab_limit: the vocabulary every read is checked against (``check_vocab``).
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        header_path = self.directory / HEADER_FILE
        if not header_path.is_file():
            raise CorpusError(f"{header_path} is missing: {self.directory} is not a corpus.")
        self.header: dict[str, Any] = json.loads(header_path.read_text(encoding="utf-8"))
        if self.header.get("format") != FORMAT_VERSION:
            raise CorpusError(
                f"{header_path} is not a corpus of format {FORMAT_VERSION}: write it again."
            )
        if not self.header["complete"]:
            raise CorpusError(
                f"{self.directory} was not written to the end ({self.header['n_docs']} "
                "documents so far): run write_corpus again with the same inputs to finish it."
            )
        self.dtype = np.dtype(self.header["dtype"])
        self._check_sizes()
        self.vocab_limit: int | None = None
        self.bytes_read = 0  # token bytes sliced by __getitem__, for measuring a process's share
        self._maps: dict[str, np.ndarray] = {}
        if len(self) and int(self.ends[-1]) != self.n_tokens:
            raise CorpusError(
                f"{self.directory / OFFSETS_FILE} is damaged: its last document ends at token "
                f"{int(self.ends[-1])}, not at the {self.n_tokens} tokens the header records."
            )

    def _check_sizes(self) -> None:
        for name, size in _file_sizes(self.header).items():
            path = self.directory / name
            actual = path.stat().st_size if path.exists() else 0
            if actual < size:
                raise CorpusError(
                    f"{path} is truncated: it ends at byte offset {actual}, but the header "
                    f"records {size} bytes. Copy the corpus again from where it was "
                    "written, or delete the folder and write it again (write_corpus)."
                )

    def _mapped(self, name: str, dtype: np.dtype[Any] | str, count: int) -> np.ndarray:
        """A data file, memory-mapped on first use (and after unpickling)."""
        if name not in self._maps:
            path = self.directory / name
            empty = np.empty(0, dtype)  # np.memmap refuses a zero-length file
            self._maps[name] = np.memmap(path, dtype, "r", shape=(count,)) if count else empty
        return self._maps[name]

    @property
    def tokens(self) -> np.ndarray:
        """The flat token array (memory-mapped)."""
        return self._mapped(TOKENS_FILE, self.dtype, self.n_tokens)

    @property
    def ends(self) -> np.ndarray:
        """Each document's end in ``tokens`` (memory-mapped: 8 bytes a document, read only
        at the documents asked for)."""
        return self._mapped(OFFSETS_FILE, "<i8", int(self.header["n_docs"]))

    @property
    def n_tokens(self) -> int:
        return int(self.header["n_tokens"])

    @property
    def vocab_size(self) -> int:
        """The vocabulary of the tokenizer that wrote the corpus."""
        return int(self.header["vocab_size"])

    def __len__(self) -> int:
        return int(self.header["n_docs"])

    def span(self, index: int) -> tuple[int, int]:
        """Document ``index``'s ``[start, end)`` in the flat token array."""
        if not -len(self) <= index < len(self):
            raise IndexError(f"document {index} of a corpus of {len(self)}")
        index %= len(self)
        start = int(self.ends[index - 1]) if index else 0
        return start, int(self.ends[index])

    def __getitem__(self, index: int) -> np.ndarray:
        start, end = self.span(index)
        return self.read(start, end, f"Document {index}")

    def read(self, start: int, end: int, what: str = "") -> np.ndarray:
        """Tokens ``[start, end)`` as ``int32``: the one read of the token file (counted in
        ``bytes_read``, checked against ``check_vocab``'s vocabulary)."""
        ids = np.asarray(self.tokens[start:end], dtype=np.int32)
        self.bytes_read += count_read(self.directory, len(ids) * self.dtype.itemsize)
        if self.vocab_limit is not None and len(ids) and int(ids.max()) >= self.vocab_limit:
            raise CorpusError(
                f"{what or f'Tokens {start}:{end}'} of {self.directory} holds id "
                f"{int(ids.max())}, outside the model's vocabulary of {self.vocab_limit}."
            )
        return ids

    def check_vocab(self, vocab_size: int) -> None:
        """Refuses a corpus whose ids reach ``vocab_size`` (from the largest id the writer
        recorded: no token is read) and has every later read check its document too."""
        if self.header["max_id"] >= vocab_size:
            raise CorpusError(
                f"{self.directory} holds ids up to {self.header['max_id']} (tokenizer "
                f"vocabulary {self.vocab_size}), but the model's vocabulary is {vocab_size}: "
                "the corpus was tokenized for another model. Tokenize it again with the "
                "model's tokenizer, or give the model a vocabulary of at least "
                f"{self.header['max_id'] + 1}."
            )
        self.vocab_limit = vocab_size

    def verify(self) -> None:
        """Reads every chunk and compares its CRC32 with the header's (reads the whole
        corpus: for a check after copying, not for each training process)."""
        token_start = doc_start = 0
        chunks = self._mapped(CHUNKS_FILE, CHUNK_RECORD, int(self.header["n_chunks"]))
        for number, chunk in enumerate(chunks):
            n_tokens, n_docs = int(chunk["n_tokens"]), int(chunk["n_docs"])
            tokens = np.asarray(self.tokens[token_start : token_start + n_tokens])
            ends = np.asarray(self.ends[doc_start : doc_start + n_docs])
            for name, data, crc, start in (
                (TOKENS_FILE, tokens, chunk["tokens_crc32"], token_start * self.dtype.itemsize),
                (OFFSETS_FILE, ends, chunk["offsets_crc32"], doc_start * 8),
            ):
                if zlib.crc32(data.tobytes()) != int(crc):
                    raise CorpusError(
                        f"{self.directory / name} is damaged: chunk {number}, from byte "
                        f"offset {start}, does not match its checksum."
                    )
            token_start += n_tokens
            doc_start += n_docs

    def tokenizer(self) -> Tokenizer:
        """The tokenizer saved beside the corpus."""
        return load_tokenizer(self.directory)

    def __getstate__(self) -> dict[str, Any]:
        # Grain's worker processes get the corpus pickled: the path, not the mapped tokens
        return {**self.__dict__, "_maps": {}}

    def __repr__(self) -> str:
        return f"Corpus({os.fspath(self.directory)!r}, docs={len(self)}, tokens={self.n_tokens})"
