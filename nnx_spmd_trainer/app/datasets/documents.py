"""Language modelling on documents of BPE tokens, packed: the default job's data.

The pydoc topics (``pydoc_data.topics``, one topic a document) are tokenized by a
byte-level BPE (``data.train_bpe``, trained on them in about a second, the same
merges every time) and packed into rows (``data.PackedBlocks``: the same rows on any
process count): each row carries ``segment_ids`` and ``positions``, and no target
crosses a document.

Held out is the same text the character job holds out: the end of the topics in
sorted order (``split_documents`` cuts the topic where the cut falls in two).
Its rows are windows inside one document each, every target trained, so each
held-out batch has the same count of targets: the mean of the batches' losses
is the loss per target token, and ``Splits.bytes_per_target`` turns it into bits
per byte.

>>> tokenizer = pydoc_tokenizer(vocab_size=300)
>>> splits = bpe_lm_splits(tokenizer, seq_len=16, batch_size=4, seed=0, max_eval_batches=1)
>>> sorted(next(iter(splits.train)))
['inputs', 'positions', 'segment_ids', 'target_segment_ids', 'targets']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NotRequired, Unpack

import grain
import numpy as np

from nnx_spmd_trainer.app.datasets.base import Batch, Splits, index_batches
from nnx_spmd_trainer.app.datasets.text import SplitOptions
from nnx_spmd_trainer.data import CHATML_TOKENS, EOS_TOKEN, PackedBlocks, Tokenizer, train_bpe

__all__ = [
    "DocumentOptions",
    "bpe_lm_splits",
    "document_splits",
    "held_out_batches",
    "pydoc_documents",
    "pydoc_tokenizer",
    "split_documents",
    "tokenize",
]


def pydoc_documents() -> list[str]:
    """The pydoc topics, one document each, in sorted key order (``load_text``'s order)."""
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def pydoc_tokenizer(vocab_size: int = 1024) -> Tokenizer:
    """A byte-level BPE trained on the pydoc topics (deterministic: the same file each time),
    with ChatML's special tokens after the end of a document's.

    Trained on all the topics, held-out ones included: the tokenizer sees the text,
    never the model's loss; the unigram baseline is counted on the training rows only.
    """
    # ChatML's markers reserved as special tokens: a chat fine-tune of this run's model
    # (data.chat_template=chatml) writes each as one token, and <|im_end|> can end a turn.
    special = (EOS_TOKEN, *CHATML_TOKENS)
    return train_bpe(texts=pydoc_documents(), vocab_size=vocab_size, special_tokens=special)


def split_documents(documents: Sequence[str], eval_fraction: float) -> tuple[list[str], list[str]]:
    """``(train, held_out)``: the last ``eval_fraction`` of the characters held out, as
    ``split_tokens`` cuts the character job's text; the document the cut falls in
    gives its head to training and its tail to the held-out set.

    >>> split_documents(["abcd", "efghij"], 0.3)
    (['abcd', 'efg'], ['hij'])
    """
    if not 0 < eval_fraction < 1:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}.")
    cut = int(sum(map(len, documents)) * (1 - eval_fraction))
    train: list[str] = []
    for number, document in enumerate(documents):
        if cut <= len(document):
            head, tail = document[:cut], document[cut:]
            return [*train, *([head] if head else [])], [tail, *documents[number + 1 :]]
        train.append(document)
        cut -= len(document)
    return train, []


def tokenize(tokenizer: Tokenizer, texts: Sequence[str]) -> list[np.ndarray]:
    """Each text's ids, ended by the tokenizer's end-of-document id when it has one."""
    encoded = tokenizer.encode_batch(texts)
    if tokenizer.eos_id is None:
        return encoded
    eos = np.array([tokenizer.eos_id], np.int32)
    return [np.concatenate([ids, eos]) for ids in encoded]


def _windows_of(documents: Sequence[np.ndarray], seq_len: int) -> list[tuple[int, int]]:
    """``(document, start)`` of every full window of ``seq_len`` targets inside a document."""
    return [
        (number, start)
        for number, ids in enumerate(documents)
        for start in range(0, len(ids) - seq_len, seq_len)
    ]


def held_out_batches(
    documents: Sequence[np.ndarray],
    *,
    seq_len: int,
    batch_size: int,
    max_batches: int | None = None,
    shard: tuple[int, int] = (0, 1),
) -> tuple[grain.MapDataset[Batch], list[np.ndarray]]:
    """Fixed batches of windows inside held-out documents, and the targets they score.

    A window is ``ids[s : s + seq_len]`` -> ``ids[s + 1 : s + seq_len + 1]`` at
    ``s = 0, seq_len, 2 seq_len, ...``: one segment, positions from 0, every target
    trained; a document's tail shorter than a window is left out.

    Returns:
      The batches (finite, re-iterable) and, per document, the ids whose targets are
      scored, ``ids[: windows * seq_len + 1]`` (for the baseline and the bytes).
    """
    windows = _windows_of(documents, seq_len)
    limit = len(windows) if max_batches is None else max_batches * batch_size * shard[1]
    per_batch = batch_size * shard[1]
    windows = windows[: min(limit, len(windows)) // per_batch * per_batch]
    if not windows:
        tokens = sum(map(len, documents))
        raise ValueError(
            f"{tokens} held-out tokens give fewer than one batch of {batch_size} windows of "
            f"seq_len={seq_len} inside a document. Hold out more text or use smaller batches."
        )
    counts = np.bincount([number for number, _ in windows], minlength=len(documents))
    scored = [ids[: k * seq_len + 1] for ids, k in zip(documents, counts, strict=True) if k]
    table = np.stack([documents[n][s : s + seq_len + 1] for n, s in windows])

    def gather(index: np.ndarray) -> Batch:
        rows = table[index]
        ones = np.ones((len(index), seq_len), np.int32)
        return {
            "inputs": rows[:, :-1],
            "targets": rows[:, 1:],
            "segment_ids": ones,
            "positions": np.broadcast_to(np.arange(seq_len, dtype=np.int32), ones.shape).copy(),
            "target_segment_ids": ones,
        }

    return index_batches(len(windows), batch_size, gather, shard=shard), scored


def _target_bytes(tokenizer: Tokenizer, scored: Sequence[np.ndarray]) -> int:
    """UTF-8 bytes of the targets ``scored[d][1:]``: the decoded document less its first
    token (a prefix decoded, so a character split between tokens counts once)."""
    total = 0
    for ids in scored:
        total += len(tokenizer.decode(ids).encode("utf-8"))
        total -= len(tokenizer.decode(ids[:1]).encode("utf-8"))
    return total


def document_splits(
    train_documents: Any,
    held_out: Sequence[np.ndarray],
    tokenizer: Tokenizer,
    train_counts: np.ndarray,
    *,
    seq_len: int,
    batch_size: int,
    seed: int,
    max_eval_batches: int | None = None,
    shard: tuple[int, int] = (0, 1),
    packed: bool = True,
    train_rows: grain.IterDataset[Batch] | None = None,
) -> Splits:
    """Packed training rows of ``train_documents``, held-out windows of ``held_out``, the
    unigram baseline from ``train_counts`` (token frequencies) and the bytes per target.

    Args:
      train_documents: a random-access source of documents' ids (a list, a ``Corpus``).
      held_out: the held-out documents' ids.
      train_counts: how often each id occurs in training (``np.bincount``).
      batch_size: rows a batch for this process.
      train_rows: batches to train on instead of packing ``train_documents`` (a mixture).
    """
    train = train_rows
    if train is None:
        # the same global rows on any process count (data.packed_blocks); packed rows carry
        # target_segment_ids: their targets never leave the document
        train = PackedBlocks(
            train_documents, seq_len, batch_size * shard[1], shard, seed=seed, packed=packed
        )
    held_out_data, scored = held_out_batches(
        held_out, seq_len=seq_len, batch_size=batch_size, max_batches=max_eval_batches, shard=shard
    )
    targets = np.concatenate([ids[1:] for ids in scored])
    counts = np.zeros(max(tokenizer.vocab_size, len(train_counts)), np.float64)
    counts[: len(train_counts)] = train_counts
    baseline = _unigram(counts, targets)
    bytes_per_target = _target_bytes(tokenizer, scored) / len(targets)
    return Splits(train, held_out_data, baseline, "unigram baseline", bytes_per_target, tokenizer)


def _unigram(counts: np.ndarray, targets: np.ndarray) -> float:
    """``text.unigram_baseline`` from counts (Laplace-smoothed): nats per target.

    >>> round(_unigram(np.array([2.0, 1.0]), np.array([0, 1])), 4)  # counts of [0, 0, 1]
    0.7136
    """
    log_probs = np.log(counts + 1.0) - np.log((counts + 1.0).sum())
    return float(-log_probs[targets].mean())


class DocumentOptions(SplitOptions):
    """``SplitOptions`` and ``packed``: documents packed into rows (default), or one
    document's piece a row, padded."""

    packed: NotRequired[bool]


def bpe_lm_splits(
    tokenizer: Tokenizer,
    *,
    documents: Sequence[str] | None = None,
    max_steps: int = 0,
    **options: Unpack[DocumentOptions],
) -> Splits:
    """Packed rows of ``documents`` (default: the pydoc topics) in ``tokenizer``'s ids;
    ``options``: ``DocumentOptions``; ``max_steps``: the steps a dry run's line counts
    the epochs of."""
    documents = pydoc_documents() if documents is None else documents
    train_text, held_out_text = split_documents(documents, options.get("eval_fraction", 0.1))
    train = tokenize(tokenizer, train_text)
    vocab = tokenizer.vocab_size
    counts = np.bincount(np.concatenate(train), minlength=vocab) if train else np.zeros(vocab)
    held_out = tokenize(tokenizer, held_out_text)
    rows = options["batch_size"] * options.get("shard", (0, 1))[1]
    trained = int(counts.sum())
    summary = (
        f"data: {len(train)} documents, {trained} tokens trained on (a tokenizer of "
        f"{vocab} ids), {len(held_out)} held out; "
        f"{'packed' if options.get('packed', True) else 'one document piece a row'}; "
        f"{max_steps} steps of {rows} rows x {options['seq_len']} tokens read them "
        f"~{max_steps * rows * options['seq_len'] / max(trained, 1):.2f} times (epochs)",
    )
    splits = document_splits(
        train,
        held_out,
        tokenizer,
        counts,
        seq_len=options["seq_len"],
        batch_size=options["batch_size"],
        seed=options["seed"],
        max_eval_batches=options.get("max_eval_batches"),
        shard=options.get("shard", (0, 1)),
        packed=options.get("packed", True),
    )
    return dataclasses.replace(splits, summary=summary)
