"""Documents packed into rows with Grain's own packing, with segments and positions.

Rows are ``{"inputs", "targets", "segment_ids", "positions"}``, each ``int32
(seq_len,)``, the shapes the app's language-model task reads (``targets`` is
``inputs`` shifted by one, ``app/datasets/text.py``), plus:

- ``segment_ids``: ``1, 2, ...`` for the documents of a row in order, ``0`` for padding.
  The loss skips ``segment_ids == 0``; attention lets a token see only its own segment.
- ``positions``: ``0, 1, ...`` restarting at every segment.
- ``target_segment_ids``: the segment of each target, the same as ``segment_ids``
  (a row's targets never leave their input's document), so
  ``nn.packed.target_weights`` trains every pair, a segment's last one included.
- ``loss_weights`` (rows of weighted documents only, ``weighted=True``): ``float32``, the
  weight of each target (chat data: 1 on the assistant's tokens, ``data.chat``), 0 on padding.

How a document becomes segments (``split_document``): a document of ``n`` ids
gives the ``n - 1`` (input, target) pairs ``ids[j] -> ids[j+1]``, so no target is
ever the first token of another document. Pairs are cut into chunks of at most
``seq_len``; every chunk, the continuation of a long document included, is its own
segment whose positions restart at 0. Every target of the document is predicted
exactly once, and the loss keeps the first pair of a continued chunk (it is
predicted from one token of context, as at the start of any document). A document
of fewer than 2 ids has no pair and is dropped. (Rows packed by hand with no
``target_segment_ids`` are read otherwise: see ``nn.packed.target_weights``.)

The packing itself is Grain's (``grain.experimental.FirstFitPackIterDataset``, or
``BestFitPackIterDataset`` with ``best_fit=True``), wrapped, not written again: it
makes the segment ids and positions, and its iterator's ``get_state`` /
``set_state`` is the data position a checkpoint saves (``RunState.data``), so a
packed input pipeline resumes exactly on the same process count. Each process packs
the documents of its own shard, so on another process count the rows differ: a
mixture of row sources (``data.mixture``) is what resumes exactly there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grain
import numpy as np

from nnx_spmd_trainer.data_shard import DataShard

Row = dict[str, np.ndarray]

#: The keys of a packed row (and of a batch of them).
ROW_KEYS = ("inputs", "targets", "segment_ids", "positions", "target_segment_ids")

#: The key of the per-target loss weights a row of weighted documents also carries
#: (``float32``, aligned with ``targets``, 0 on padding; ``data.chat``'s assistant mask).
LOSS_WEIGHTS = "loss_weights"

#: Documents read in the packing thread itself. Grain's default (16 reader threads)
#: costs more in bookkeeping than a memory-map read saves: packing a corpus ran 4x
#: slower with it (0.29 vs 0.48 M tokens/s). The trainer's prefetch already runs the
#: whole input pipeline beside the step.
SYNCHRONOUS = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


def split_document(document: np.ndarray | Row, seq_len: int) -> list[Row]:
    """A document's (input, target) pairs in chunks of at most ``seq_len``, one segment each.

    A weighted document (``{"ids", "loss_weights"}``, ``data.chat``'s) gives each chunk the
    weights of its targets, ``loss_weights[1:]``, as ``loss_weights``.

    >>> [c["inputs"].tolist() for c in split_document(np.arange(6), 3)]
    [[0, 1, 2], [3, 4]]
    >>> [c["targets"].tolist() for c in split_document(np.arange(6), 3)]
    [[1, 2, 3], [4, 5]]
    >>> weighted = {"ids": np.arange(4), "loss_weights": np.array([0.0, 0.0, 1.0, 1.0])}
    >>> [c["loss_weights"].tolist() for c in split_document(weighted, 2)]
    [[0.0, 1.0], [1.0]]
    """
    weights = None
    if isinstance(document, dict):
        weights = np.asarray(document["loss_weights"], dtype=np.float32)[1:]
        document = document["ids"]
    ids = np.asarray(document, dtype=np.int32)
    inputs, targets = ids[:-1], ids[1:]
    chunks = []
    for start in range(0, len(inputs), seq_len):
        chunk: Row = {
            "inputs": inputs[start : start + seq_len],
            "targets": targets[start : start + seq_len],
        }
        if weights is not None:
            chunk[LOSS_WEIGHTS] = weights[start : start + seq_len]
        chunks.append(chunk)
    return chunks


class _SplitDocuments(grain.experimental.FlatMapTransform):
    """``split_document`` as a Grain flat map (a long document gives several elements)."""

    def __init__(self, seq_len: int) -> None:
        self.seq_len = seq_len
        self.max_fan_out = 1 << 30  # only a MapDataset's flat map reads it; ours is an IterDataset

    def flat_map(self, element: np.ndarray | Row) -> Sequence[Row]:
        return split_document(element, self.seq_len)


def _row(packed: dict[str, np.ndarray]) -> Row:
    """Grain's packed element (``inputs_segment_ids``, ...) under the row's names."""
    segment_ids = packed["inputs_segment_ids"].astype(np.int32)
    row = {
        "inputs": packed["inputs"].astype(np.int32),
        "targets": packed["targets"].astype(np.int32),
        "segment_ids": segment_ids,
        "positions": packed["inputs_positions"].astype(np.int32),
        "target_segment_ids": segment_ids.copy(),
    }
    if LOSS_WEIGHTS in packed:  # Grain pads it with 0: padding is never trained
        row[LOSS_WEIGHTS] = packed[LOSS_WEIGHTS].astype(np.float32)
    return row


def pack_documents(
    documents: grain.MapDataset[Any] | grain.IterDataset[Any],
    seq_len: int,
    *,
    packed: bool = True,
    num_packing_bins: int = 16,
    best_fit: bool = False,
    seed: int = 0,
    shuffle_bins: bool = True,
    read_options: grain.ReadOptions = SYNCHRONOUS,
    weighted: bool = False,
) -> grain.IterDataset[Row]:
    """Rows of ``seq_len`` from a dataset of documents (``int`` id arrays).

    Args:
      documents: the documents in reading order (already shuffled and sharded).
      seq_len: tokens per row.
      packed: ``False`` gives one segment per row, padded (Grain's packer with one
        sequence a bin): the baseline packing is measured against.
      num_packing_bins: rows Grain fills at once; more bins, less padding.
      best_fit: Grain's best-fit packer instead of first-fit.
      seed, shuffle_bins: Grain's shuffle of the rows of each round of bins.
      read_options: how a ``MapDataset`` of documents is read (threads, buffer).
      weighted: the documents are ``{"ids", "loss_weights"}`` (``loss_weights[t]``: the
        weight of predicting ``ids[t]``; ``data.conversations.chat_documents`` makes them), and each
        row also carries ``loss_weights`` (``LOSS_WEIGHTS``), aligned with its targets.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be positive, got {seq_len}.")
    if isinstance(documents, grain.MapDataset):
        documents = documents.to_iter_dataset(read_options)
    chunks = grain.experimental.FlatMapIterDataset(documents, _SplitDocuments(seq_len))
    packer = (
        grain.experimental.BestFitPackIterDataset
        if best_fit
        else grain.experimental.FirstFitPackIterDataset
    )
    rows = packer(
        chunks,
        length_struct={
            "inputs": seq_len,
            "targets": seq_len,
            **({LOSS_WEIGHTS: seq_len} if weighted else {}),
        },
        num_packing_bins=num_packing_bins if packed else 1,
        seed=seed,
        shuffle_bins=shuffle_bins,
        max_sequences_per_bin=None if packed else 1,
    )
    return rows.map(_row)


def packed_pipeline(
    source: Any,
    seq_len: int,
    global_batch_size: int,
    shard: DataShard | tuple[int, int] = (0, 1),
    *,
    seed: int | None = 0,
    repeat: bool = True,
    packed: bool = True,
    num_packing_bins: int | None = None,
    read_options: grain.ReadOptions = SYNCHRONOUS,
    weighted: bool = False,
) -> grain.IterDataset[Row]:
    """source -> shuffle -> repeat -> this process's documents -> pack -> batch.

    Like ``grain_pipeline``, every process shuffles the same global order of
    documents and takes ``docs[index::count]``; it then packs its own documents
    into its ``global_batch_size // count`` rows a step. A random-access source
    (a ``Corpus``) is read only at the documents this process takes.

    Args:
      source: a random-access source of documents (``Corpus``, a list of arrays).
      seq_len: tokens per row.
      global_batch_size: rows per step over all processes.
      shard: which documents this process reads (``trainer.placement.data_shard``).
      num_packing_bins: Grain's bins (default: the process's rows a step).
      read_options: how the documents are read (default: in the packing thread).
      weighted: documents with per-token loss weights (``pack_documents``): chat data.
    """
    index, count = shard
    if global_batch_size % count:
        raise ValueError(
            f"A global batch of {global_batch_size} rows cannot be split between "
            f"{count} processes; use a multiple of {count}."
        )
    documents = grain.MapDataset.source(source)
    if seed is not None:
        documents = documents.shuffle(seed=seed)
    if repeat:
        documents = documents.repeat(None)
    if count > 1:
        documents = documents[index::count]
    rows_per_process = global_batch_size // count
    rows = pack_documents(
        documents,
        seq_len,
        packed=packed,
        num_packing_bins=num_packing_bins or rows_per_process,
        seed=seed or 0,
        read_options=read_options,
        weighted=weighted,
    )
    return rows.batch(rows_per_process, drop_remainder=True)


def padding_share(segment_ids: np.ndarray) -> float:
    """The share of a row's (or batch's) tokens that are padding (``segment_ids == 0``).

    >>> padding_share(np.array([[1, 1, 2, 0], [1, 0, 0, 0]]))
    0.5
    """
    return float(np.mean(np.asarray(segment_ids) == 0))


class ContiguousRows:
    """A corpus cut into rows every ``seq_len`` tokens: the random-access form of
    concat-then-split, for sources a ``Mixture`` reads by index.

    Row ``r`` holds the pairs ``tokens[j] -> tokens[j+1]`` for ``j`` in
    ``[first + r * seq_len, first + (r + 1) * seq_len)``, with the segments and positions of
    ``pack_documents``: a segment per document (a document continued from the row
    before is a new segment, its positions restarting at 0), and ``segment_ids``
    0 at the pair whose target is the next document's first token. So it holds
    the pairs ``split_document`` gives, cut at other places, with no padding but
    those boundary pairs. Grain's ``ConcatThenSplitIterDataset`` gives rows of this
    kind as an iterator; a mixture resumed on another process count needs row
    ``r`` without reading rows ``0..r-1``, so this reads it from the corpus by index.

    Args:
      corpus: a ``Corpus`` (anything with ``span``, ``ends`` and ``read``).
      seq_len: pairs per row.
      documents: the ``(start, stop)`` documents cut into rows (default: all; e.g. all
        but those held out for evaluation).
    """

    def __init__(self, corpus: Any, seq_len: int, documents: tuple[int, int] | None = None) -> None:
        start, stop = documents if documents is not None else (0, len(corpus))
        if not 0 <= start < stop <= len(corpus):
            raise ValueError(f"documents {start}:{stop} of a corpus of {len(corpus)}.")
        self.corpus, self.seq_len = corpus, seq_len
        self.first, self.end = corpus.span(start)[0], corpus.span(stop - 1)[1]
        self._rows = (self.end - self.first - 1) // seq_len  # the last pair needs one more
        if self._rows < 1:
            raise ValueError(f"{corpus} documents {start}:{stop} hold no row of {seq_len}.")

    def __len__(self) -> int:
        return self._rows

    def __getitem__(self, index: int) -> Row:
        if not 0 <= index < self._rows:
            raise IndexError(f"row {index} of {self._rows}")
        start = self.first + index * self.seq_len
        window = self.corpus.read(start, start + self.seq_len + 1, f"Row {index}")
        at = start + np.arange(self.seq_len)
        document = np.searchsorted(self.corpus.ends, at, side="right")  # of each input
        inside = document == np.searchsorted(self.corpus.ends, at + 1, side="right")
        first = np.searchsorted(document, document, side="left")  # the segment's first place
        segment_ids = np.zeros(self.seq_len, np.int32)  # 1, 2, ... for the documents with a pair
        segment_ids[inside] = 1 + np.searchsorted(np.unique(document[inside]), document[inside])
        return {
            "inputs": window[:-1],
            "targets": window[1:],
            "segment_ids": segment_ids,
            "positions": np.where(inside, np.arange(self.seq_len) - first, 0).astype(np.int32),
            "target_segment_ids": segment_ids.copy(),  # a pair across documents: 0 in both
        }
