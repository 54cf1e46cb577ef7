"""Training on corpora written by ``nnx-spmd-train corpus`` (``data.write_corpus``): one
packed by Grain, several mixed by weight (``data.mixture``).

Each corpus holds out its last documents (``eval_fraction`` of them, at least
one), read only as far as the held-out batches need. Training reads documents
before those:

- one corpus, no weights: its documents shuffled and packed block by block into the
  same global rows on any process count, each process reading the chunks of its own
  rows (``data.PackedBlocks``);
- several corpora (or weights, or stages): a ``data.mixture.Mixture`` of each
  corpus's ``data.packing.ContiguousRows``, rows cut from its flat token array one
  after another (the documents' order as written; a row may hold the end of one
  document and the start of the next, as separate segments). Random access to
  rows is what lets the mixture's position be the step alone, so it resumes
  exactly on any process count.

The unigram baseline counts the first ``BASELINE_SAMPLE`` training tokens of each
corpus (not the whole corpus: no process reads it all).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from nnx_spmd_trainer.app.datasets.base import Splits
from nnx_spmd_trainer.app.datasets.documents import document_splits
from nnx_spmd_trainer.data import ContiguousRows, Corpus, Mixture, Stage, Tokenizer

__all__ = ["BASELINE_SAMPLE", "DocumentRange", "corpus_splits", "held_out_range"]

#: Training tokens per corpus the unigram baseline counts.
BASELINE_SAMPLE = 1 << 22


class DocumentRange:
    """Documents ``[start, stop)`` of a corpus as a random-access source of id arrays."""

    def __init__(self, corpus: Corpus, start: int, stop: int) -> None:
        self.corpus, self.start, self.stop = corpus, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < len(self):
            raise IndexError(f"document {index} of {len(self)}")
        return self.corpus[self.start + index]

    def span(self, index: int) -> tuple[int, int]:
        """Document ``index``'s ``[start, end)`` in the corpus's token array (reads its
        offsets only): ``data.PackedBlocks`` lays rows out from it."""
        if not 0 <= index < len(self):
            raise IndexError(f"document {index} of {len(self)}")
        return self.corpus.span(self.start + index)

    def read(self, start: int, end: int, what: str = "") -> np.ndarray:
        """Tokens ``[start, end)`` of the corpus (``Corpus.read``): a chunk, not a document."""
        return self.corpus.read(start, end, what)


def held_out_range(corpus: Corpus, eval_fraction: float) -> tuple[int, int]:
    """``(first held-out document, documents)``: the last ``eval_fraction`` (at least one,
    and one left to train on)."""
    held = min(max(1, int(len(corpus) * eval_fraction)), len(corpus) - 1)
    return len(corpus) - held, len(corpus)


def _held_out(
    corpora: Mapping[str, Corpus], eval_fraction: float, seq_len: int, needed_windows: int | None
) -> list[np.ndarray]:
    """Held-out documents, one from each corpus in turn, until they hold the windows needed
    (``None``: all of them)."""
    ranges = {name: held_out_range(c, eval_fraction) for name, c in corpora.items()}
    documents: list[np.ndarray] = []
    windows, offset = 0, 0
    while any(first + offset < stop for first, stop in ranges.values()):
        for name, (first, stop) in ranges.items():
            if first + offset < stop:
                ids = corpora[name][first + offset]
                documents.append(ids)
                windows += max(0, (len(ids) - 1) // seq_len)
        if needed_windows is not None and windows >= needed_windows:
            break
        offset += 1
    return documents


def _counts(corpora: Mapping[str, Corpus], eval_fraction: float, vocab: int) -> np.ndarray:
    counts = np.zeros(vocab, np.int64)
    for corpus in corpora.values():
        first_held = held_out_range(corpus, eval_fraction)[0]
        stop = min(corpus.span(first_held)[0], BASELINE_SAMPLE)
        counts += np.bincount(np.asarray(corpus.tokens[:stop]), minlength=vocab)[:vocab]
    return counts


def corpus_splits(
    corpora: Mapping[str, Corpus],
    tokenizer: Tokenizer,
    *,
    stages: Sequence[Stage | tuple[int, Mapping[str, float]]] | None,
    max_steps: int,
    seq_len: int,
    batch_size: int,
    seed: int,
    eval_fraction: float,
    max_eval_batches: int | None,
    shard: tuple[int, int],
    packed: bool,
) -> Splits:
    """Training batches of ``corpora`` (packed, or mixed by ``stages``), held-out windows of
    their last documents, the unigram baseline, and what a dry run prints.

    Raises ``MixtureError`` for weights that do not fit the corpora, ``ValueError``
    for a mixture of unpacked rows.
    """
    train_ranges = {name: (0, held_out_range(c, eval_fraction)[0]) for name, c in corpora.items()}
    summary = [
        f"data: corpus {name} ({c.directory}): {len(c)} documents, {c.n_tokens} tokens; "
        f"{train_ranges[name][1]} documents trained on, the last "
        f"{len(c) - train_ranges[name][1]} held out"
        for name, c in corpora.items()
    ]
    tokens_read = max_steps * batch_size * shard[1] * seq_len
    train_rows = None
    if stages is None:
        ((name, corpus),) = corpora.items()
        train_documents: Any = DocumentRange(corpus, *train_ranges[name])
        trained = corpus.span(train_ranges[name][1] - 1)[1]
        summary.append(
            f"data: {'packed' if packed else 'one document piece a row'}; {max_steps} steps "
            f"of {batch_size * shard[1]} rows x {seq_len} tokens read corpus {name} "
            f"~{tokens_read / max(trained, 1):.2f} times (epochs)"
        )
    else:
        if not packed:
            raise ValueError(
                "a mixture's rows are cut from each corpus's token stream (packed); "
                "config.data.packed=False takes one corpus and no weights."
            )
        sources = {
            name: ContiguousRows(corpus, seq_len, train_ranges[name])
            for name, corpus in corpora.items()
        }
        mixture = Mixture(
            sources,
            stages,
            global_batch_size=batch_size * shard[1],
            shard=shard,
            seed=seed,
            max_steps=max_steps,  # a stage the run never reaches is refused
        )
        train_rows, train_documents = mixture, []
        for stage in mixture.stages:
            total = sum(float(w) for w in stage.weights.values())
            shares = ", ".join(f"{n} {float(w) / total:.3f}" for n, w in stage.weights.items())
            summary.append(f"data: mixture from step {stage.start}: {shares}")
        epochs = ", ".join(f"{n} {e:.3f}" for n, e in mixture.epochs(max_steps).items())
        summary.append(f"data: epochs of each corpus in {max_steps} steps: {epochs}")
    needed = None if max_eval_batches is None else max_eval_batches * batch_size * shard[1]
    held_out = _held_out(corpora, eval_fraction, seq_len, needed)
    counts = _counts(corpora, eval_fraction, tokenizer.vocab_size)
    splits = document_splits(
        train_documents,
        held_out,
        tokenizer,
        counts,
        seq_len=seq_len,
        batch_size=batch_size,
        seed=seed,
        max_eval_batches=max_eval_batches,
        shard=shard,
        packed=packed,
        train_rows=train_rows,
    )
    return Splits(
        splits.train,
        splits.eval,
        splits.baseline,
        splits.baseline_name,
        splits.bytes_per_target,
        tokenizer,
        tuple(summary),
    )
