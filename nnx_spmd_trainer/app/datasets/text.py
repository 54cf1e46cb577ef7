"""Character-level language modelling on text every CPython ships: ``pydoc_data.topics``.

>>> tokenizer, splits = char_lm_splits(seq_len=32, batch_size=8, seed=0)
>>> batch = next(iter(splits.train))
>>> batch["inputs"].shape, batch["inputs"].dtype
((8, 32), dtype('int32'))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import NotRequired, TypedDict, Unpack

import grain
import numpy as np

from nnx_spmd_trainer.app.datasets.base import Batch, Splits, index_batches

__all__ = [
    "CharTokenizer",
    "GPT2ByteTokenizer",
    "SplitOptions",
    "byte_lm_splits",
    "char_lm_splits",
    "eval_batches",
    "load_text",
    "split_tokens",
    "train_batches",
    "unigram_baseline",
]


def load_text() -> str:
    """The pydoc topic texts (about 0.5 MB of English and Python), in sorted key order."""
    from pydoc_data.topics import topics

    return "".join(topics[key] for key in sorted(topics))


class CharTokenizer:
    """One id per distinct character, in sorted order; the vocabulary is padded.

    The vocabulary size is rounded up to a multiple of ``pad_to_multiple_of``
    so embedding and output layers split evenly over a ``model`` axis of 2, 4
    or 8; the padding ids decode to nothing and never occur in encoded text.

    >>> tok = CharTokenizer("hello")
    >>> tok.num_chars, tok.vocab_size
    (4, 8)
    >>> tok.decode(tok.encode("hole"))
    'hole'
    """

    def __init__(self, text: str, *, pad_to_multiple_of: int = 8) -> None:
        if not text:
            raise ValueError("CharTokenizer needs a non-empty text to build its vocabulary.")
        self.chars: tuple[str, ...] = tuple(sorted(set(text)))
        self.num_chars = len(self.chars)
        self.vocab_size = -(-self.num_chars // pad_to_multiple_of) * pad_to_multiple_of
        self._ids = {char: i for i, char in enumerate(self.chars)}
        # a code-point -> id table encodes 0.5 MB in one vectorised lookup
        self._table = np.full(max(map(ord, self.chars)) + 1, -1, dtype=np.int32)
        self._table[[ord(c) for c in self.chars]] = np.arange(self.num_chars, dtype=np.int32)

    def encode(self, text: str) -> np.ndarray:
        """``str -> int32 ids``; a character outside the vocabulary raises ``ValueError``."""
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
        known = codes < len(self._table)
        ids = np.where(known, self._table[np.where(known, codes, 0)], -1)
        if (ids < 0).any():
            unknown = sorted({chr(c) for c in codes[ids < 0]})
            raise ValueError(f"Characters {unknown} are not in the tokenizer's vocabulary.")
        return ids.astype(np.int32)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """``ids -> str``; padding ids (``>= num_chars``) decode to nothing."""
        return "".join(
            self.chars[i] for i in np.asarray(ids).ravel().tolist() if i < self.num_chars
        )


def gpt2_byte_ranks() -> np.ndarray:
    """``ranks[b]``: the place of byte ``b`` in GPT-2's byte-to-unicode table
    (``bytes_to_unicode`` of OpenAI's ``encoder.py`` and HF's ``GPT2Tokenizer``).

    That table lists the printable bytes (``!``..``~``, ``¡``..``¬``, ``®``..``ÿ``)
    first and the other 68 after them, in byte order; GPT-2's vocabulary
    (``encoder.json``) starts with the 256 single-byte tokens in exactly that
    order, so the rank is the token id of the byte alone (space -> 220 ``Ġ``,
    newline -> 198 ``Ċ``, ``!`` -> 0).

    >>> ranks = gpt2_byte_ranks()
    >>> int(ranks[ord(" ")]), int(ranks[ord("\\n")]), int(ranks[ord("!")]), int(ranks[0])
    (220, 198, 0, 188)
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    order = printable + [b for b in range(256) if b not in printable]
    ranks = np.empty(256, dtype=np.int32)
    ranks[order] = np.arange(256, dtype=np.int32)
    return ranks


class GPT2ByteTokenizer:
    """GPT-2's byte-level tokens without its merges: each UTF-8 byte of the text is the
    id of GPT-2's token for that byte alone (``gpt2_byte_ranks``), so a GPT-2 reads it
    as text it knows, spelled one byte a token (not GPT-2's BPE, whose merges are not
    shipped here). ``vocab_size`` is GPT-2's 50257; ids 0..255 are the ones used.

    >>> tok = GPT2ByteTokenizer()
    >>> tok.encode("Hi there").tolist()
    [39, 72, 220, 83, 71, 68, 81, 68]
    >>> tok.decode(tok.encode("café\\n"))
    'café\\n'
    """

    vocab_size = 50257

    def __init__(self) -> None:
        self._ranks = gpt2_byte_ranks()
        self._bytes = np.argsort(self._ranks).astype(np.uint8)  # id -> byte

    def encode(self, text: str) -> np.ndarray:
        """``str -> int32 ids``, one per UTF-8 byte."""
        return self._ranks[np.frombuffer(text.encode("utf-8"), dtype=np.uint8)]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """``ids -> str``; ids above 255 (multi-byte tokens) are not produced and raise."""
        ids = np.asarray(ids).ravel()
        if (ids > 255).any() or (ids < 0).any():
            raise ValueError("GPT2ByteTokenizer decodes the 256 single-byte ids only.")
        return self._bytes[ids].tobytes().decode("utf-8", errors="replace")


def split_tokens(tokens: np.ndarray, eval_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """``(train, held_out)``: the last ``eval_fraction`` of the text is held out."""
    if not 0 < eval_fraction < 1:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}.")
    cut = int(len(tokens) * (1 - eval_fraction))
    return tokens[:cut], tokens[cut:]


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> Batch:
    window = tokens[starts[:, None] + np.arange(seq_len + 1)]
    return {"inputs": window[:, :-1], "targets": window[:, 1:]}


def train_batches(
    tokens: np.ndarray,
    *,
    seq_len: int,
    batch_size: int,
    seed: int,
    shard: tuple[int, int] = (0, 1),
) -> grain.MapDataset[Batch]:
    """Endless batches of windows at random offsets: ``{"inputs", "targets"}`` int32 ``(B, T)``.

    Every offset is visited once per epoch in a seeded random order, so the
    stream is the same for the same seed. ``targets`` is ``inputs`` shifted by one.
    """
    num_windows = len(tokens) - seq_len
    if num_windows < batch_size:
        raise ValueError(
            f"{len(tokens)} tokens give {num_windows} windows of seq_len={seq_len}, fewer than "
            f"one batch of {batch_size}."
        )
    gather = lambda starts: _windows(tokens, starts, seq_len)
    return index_batches(num_windows, batch_size, gather, seed=seed, repeat=True, shard=shard)


def eval_batches(
    tokens: np.ndarray,
    *,
    seq_len: int,
    batch_size: int,
    max_batches: int | None = None,
    shard: tuple[int, int] = (0, 1),
) -> grain.MapDataset[Batch]:
    """Fixed, non-overlapping windows from the start of ``tokens``; finite and re-iterable.

    The remainder that does not fill a batch is dropped; ``max_batches`` caps the count.
    """
    num_windows = (len(tokens) - 1) // seq_len
    if max_batches is not None:
        num_windows = min(num_windows, max_batches * batch_size * shard[1])
    if num_windows < batch_size * shard[1]:
        raise ValueError(
            f"{len(tokens)} held-out tokens give {num_windows} windows of seq_len={seq_len}, "
            f"fewer than one batch of {batch_size}. Hold out more text or use smaller batches."
        )
    gather = lambda index: _windows(tokens, index * seq_len, seq_len)
    return index_batches(num_windows, batch_size, gather, shard=shard)


def unigram_baseline(
    train_tokens: np.ndarray,
    eval_tokens: np.ndarray,
    *,
    vocab_size: int | None = None,
    alpha: float = 1.0,
) -> float:
    """Cross entropy (nats per token) of ``eval_tokens`` under ``train_tokens``' frequencies.

    What a model that ignores context can reach: a language model has learnt
    something only once its held-out loss is below this. Counts get ``alpha``
    added (Laplace smoothing) so a token unseen in training costs a finite amount.

    >>> round(unigram_baseline(np.array([0, 0, 1]), np.array([0, 1]), alpha=0.0), 4)
    0.752
    """
    train_tokens = np.asarray(train_tokens).ravel()
    eval_tokens = np.asarray(eval_tokens).ravel()
    if vocab_size is None:
        vocab_size = int(max(train_tokens.max(), eval_tokens.max())) + 1
    counts = np.bincount(train_tokens, minlength=vocab_size).astype(np.float64) + alpha
    log_probs = np.log(counts) - np.log(counts.sum())
    return float(-log_probs[eval_tokens].mean())


class SplitOptions(TypedDict):
    """The keywords of ``char_lm_splits`` and ``byte_lm_splits`` beside ``text``.

    Attributes:
      seq_len: tokens per example.
      batch_size: rows per batch for this process.
      seed: the training stream's shuffle seed.
      eval_fraction: the share of the text, at its end, held out (default 0.1).
      max_eval_batches: cap on held-out batches (default: all of the held-out text).
      shard: ``(process index, process count)`` (default ``(0, 1)``).
    """

    seq_len: int
    batch_size: int
    seed: int
    eval_fraction: NotRequired[float]
    max_eval_batches: NotRequired[int | None]
    shard: NotRequired[tuple[int, int]]


def char_lm_splits(
    *, text: str | None = None, **options: Unpack[SplitOptions]
) -> tuple[CharTokenizer, Splits]:
    """The tokenizer and train/eval batches of ``text`` (default: ``load_text()``), one
    token a character of it; ``options``: ``SplitOptions``."""
    text = load_text() if text is None else text
    tokenizer = CharTokenizer(text)
    utf8_bytes = lambda ids: len(tokenizer.decode(ids).encode("utf-8"))
    splits = _lm_splits(tokenizer.encode(text), tokenizer.vocab_size, utf8_bytes, **options)
    return tokenizer, dataclasses.replace(splits, codec=tokenizer)


def byte_lm_splits(
    *, text: str | None = None, **options: Unpack[SplitOptions]
) -> tuple[GPT2ByteTokenizer, Splits]:
    """``char_lm_splits`` with GPT-2's single-byte token ids (``GPT2ByteTokenizer``).

    The unigram baseline is smoothed over the 256 byte tokens (what the text can hold),
    not GPT-2's whole vocabulary.
    """
    text = load_text() if text is None else text
    tokenizer = GPT2ByteTokenizer()
    splits = _lm_splits(tokenizer.encode(text), 256, len, **options)
    return tokenizer, dataclasses.replace(splits, codec=tokenizer)


def _lm_splits(
    tokens: np.ndarray,
    baseline_vocab: int,
    utf8_bytes: Callable[[np.ndarray], int],
    *,
    seq_len: int,
    batch_size: int,
    seed: int,
    eval_fraction: float = 0.1,
    max_eval_batches: int | None = None,
    shard: tuple[int, int] = (0, 1),
) -> Splits:
    """Train/eval batches of ``tokens`` and the unigram baseline over ``baseline_vocab`` ids;
    ``utf8_bytes(ids)``: the UTF-8 bytes ids decode to (for bits per byte)."""
    train_tokens, eval_tokens = split_tokens(tokens, eval_fraction)
    train = train_batches(
        train_tokens, seq_len=seq_len, batch_size=batch_size, seed=seed, shard=shard
    )
    held_out = eval_batches(
        eval_tokens,
        seq_len=seq_len,
        batch_size=batch_size,
        max_batches=max_eval_batches,
        shard=shard,
    )
    # the baseline scores exactly the targets the model is evaluated on
    num_windows = len(held_out) * batch_size * shard[1]
    evaluated = eval_tokens[1 : num_windows * seq_len + 1]
    baseline = unigram_baseline(train_tokens, evaluated, vocab_size=baseline_vocab)
    bytes_per_target = utf8_bytes(evaluated) / max(len(evaluated), 1)
    return Splits(train, held_out, baseline, "unigram baseline", bytes_per_target)
