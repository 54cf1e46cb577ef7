"""A real tokenizer: a byte-level BPE of Hugging Face ``tokenizers``, trained or loaded.

``train_bpe`` trains one offline on the user's texts (no network: the Rust
trainer runs here); ``load_tokenizer`` reads a ``tokenizer.json`` the user
brings (GPT-2's, Llama's, one saved by ``Tokenizer.save``). Both give a
``Tokenizer``: ids as ``int32`` arrays, the vocabulary size and the
end-of-document id the corpus writer appends, and a hash that ties a corpus on
disk to the tokenizer that wrote it.

>>> tok = train_bpe(texts=["hello world, hello there"] * 8, vocab_size=300)
>>> tok.decode(tok.encode("hello there"))
'hello there'
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

#: The end-of-document token ``train_bpe`` reserves (GPT-2's spelling).
EOS_TOKEN = "<|endoftext|>"

#: The file name ``Tokenizer.save`` writes and ``load_tokenizer`` looks for in a folder.
TOKENIZER_FILE = "tokenizer.json"

# the spellings of an end-of-document token in the tokenizer.json files users bring
_EOS_SPELLINGS = (EOS_TOKEN, "</s>", "<|end_of_text|>", "<eos>", "[SEP]")


class TokenizerError(ValueError):
    """A tokenizer file that does not load, or a tokenizer unfit for a corpus."""


class Tokenizer:
    """A ``tokenizers.Tokenizer`` with the few things a corpus and a model need of it.

    Args:
      backend: the Hugging Face tokenizer.
      eos_token: the end-of-document token; ``None`` looks for a usual spelling
        (``<|endoftext|>``, ``</s>``, ...) and leaves ``eos_id`` ``None`` if none is found.
    """

    def __init__(self, backend: tokenizers.Tokenizer, eos_token: str | None = None) -> None:
        self.backend = backend
        spellings = (eos_token,) if eos_token is not None else _EOS_SPELLINGS
        found = [backend.token_to_id(s) for s in spellings]
        ids = [i for i in found if i is not None]
        if eos_token is not None and not ids:
            raise TokenizerError(f"The tokenizer has no token {eos_token!r} to end documents.")
        self.eos_id: int | None = ids[0] if ids else None

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce, its added (special) tokens included."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> np.ndarray:
        """``str -> int32 ids`` (no special tokens added)."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return np.asarray(ids, dtype=np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """``encode`` of many texts, tokenized in parallel by the Rust library."""
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encodings]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """``ids -> str``; special tokens (the end of a document) decode to nothing."""
        return str(self.backend.decode(np.asarray(ids).ravel().tolist()))

    def to_json(self) -> str:
        """The tokenizer as the text of a ``tokenizer.json``."""
        return str(self.backend.to_str())

    @property
    def sha256(self) -> str:
        """The hash of ``to_json()``: a corpus records it, and refuses another tokenizer."""
        return hashlib.sha256(self.to_json().encode("utf-8")).hexdigest()

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Writes ``directory/tokenizer.json`` (atomically) and returns its path."""
        path = Path(directory) / TOKENIZER_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        partial.write_text(self.to_json(), encoding="utf-8")
        os.replace(partial, path)
        return path

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id})"


def train_bpe(
    files: Iterable[str | os.PathLike[str]] = (),
    *,
    texts: Iterable[str] | None = None,
    vocab_size: int = 8192,
    min_frequency: int = 2,
    special_tokens: Sequence[str] = (EOS_TOKEN,),
) -> Tokenizer:
    """A byte-level BPE (GPT-2's kind: every byte has a token, so no text is unknown)
    trained on ``files`` or on ``texts``.

    Args:
      files: text files to train on, read as plain text by the Rust trainer (a folder
        stands for its files); for the documents of a JSONL file, give ``texts``.
      texts: or the texts themselves.
      vocab_size: ids in all: the 256 bytes, the merges, and ``special_tokens``.
      min_frequency: a pair seen fewer times is not merged.
      special_tokens: tokens never split or merged; the first ends a document.
    """
    paths = [
        os.fspath(p)
        for f in map(Path, files)
        for p in (sorted(q for q in f.rglob("*") if q.is_file()) if f.is_dir() else [f])
    ]
    if not paths and texts is None:
        raise ValueError("train_bpe needs files or texts to learn its merges from.")
    if vocab_size < 256 + len(special_tokens):
        raise ValueError(
            f"vocab_size={vocab_size} cannot hold the 256 byte tokens and "
            f"{len(special_tokens)} special ones."
        )
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    if paths:
        backend.train(paths, trainer)
    else:
        backend.train_from_iterator(texts or [], trainer)
    return Tokenizer(backend, special_tokens[0] if special_tokens else None)


def load_tokenizer(path: str | os.PathLike[str], *, eos_token: str | None = None) -> Tokenizer:
    """The tokenizer in a ``tokenizer.json`` (or in a folder that holds one).

    Raises ``TokenizerError`` naming the path and the fix when it does not load.
    """
    path = Path(path)
    file = path / TOKENIZER_FILE if path.is_dir() else path
    if not file.is_file():
        raise TokenizerError(
            f"No tokenizer at {file}: give the path of a tokenizer.json (Hugging Face "
            "tokenizers' format), or train one with data.train_bpe and save it."
        )
    try:
        backend = tokenizers.Tokenizer.from_file(os.fspath(file))
    except Exception as error:  # the Rust library raises bare Exceptions
        raise TokenizerError(
            f"The tokenizer file {file} does not load ({error}). It must be a "
            "tokenizer.json written by Hugging Face tokenizers (tokenizer.save, or "
            "PreTrainedTokenizerFast.save_pretrained); a vocab.json/merges.txt pair or a "
            "SentencePiece .model is converted to one with transformers first."
        ) from error
    return Tokenizer(backend, eos_token)
