"""Documents packed block by block: the same global rows, in the same order, for any
number of processes.

``packed_pipeline`` packs each process's own documents, so its rows follow the
process count. Here the packing is a function of the documents and ``seq_len``
alone (and the seed), and each process takes its part of it:

- The document order of epoch ``e`` is a seeded permutation of the documents (the
  corpus order with ``seed=None``). Block ``b`` of an epoch is documents
  ``[b * k, (b + 1) * k)`` of that order (``k = block_documents``; the epoch's last
  block may hold fewer).
- A block is packed into rows by ``first_fit`` over its chunks' lengths:
  ``packing.split_document``'s chunks (a document's ``n - 1`` (input, target) pairs
  in pieces of at most ``seq_len``, each a segment), each put into the first row
  with room, in document order. Only lengths decide it, so a block's layout is known
  without reading a token; its rows are then shuffled by ``(seed, epoch, block)``.
- The global rows are the blocks' rows one block after another; global batch ``s``
  is rows ``[s * B, (s + 1) * B)``. Process ``i`` of ``n`` feeds rows
  ``[s * B + i * B / n, s * B + (i + 1) * B / n)``: the processes' batches, laid side
  by side, are the 1-process batch in its order.
- A process reads the tokens of its own rows' chunks only (a ``Corpus`` is read at
  the chunk's span, not the whole document), so each of ``n`` processes reads about
  ``1 / n`` of the corpus bytes. Every process reads every document's *length*
  (8 bytes of a ``Corpus``'s offsets) of the blocks it passes, to know where rows fall.
- The data position is the step alone (``{"next_index": step}``, as ``Mixture``'s):
  a run stopped on 2 processes resumes on 1 (``data.BATCHES_TAKEN``) on the same rows.

Rows are those of ``packing.pack_documents``: ``inputs``, ``targets``,
``segment_ids`` (0 on padding), ``positions``, ``target_segment_ids`` and, for
weighted documents (``{"ids", "loss_weights"}``, ``data.chat``'s), ``loss_weights``.

>>> docs = [np.arange(5), np.arange(3), np.arange(3)]
>>> blocks = PackedBlocks(docs, seq_len=4, global_batch_size=2, seed=None, repeat=False)
>>> [blocks.row(r)["segment_ids"].tolist() for r in range(blocks.rows_in_epoch(0))]
[[1, 1, 1, 1], [1, 1, 2, 2]]
>>> [blocks.row(r)["inputs"].tolist() for r in range(blocks.rows_in_epoch(0))]
[[0, 1, 2, 3], [0, 1, 0, 1]]
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import grain
import numpy as np

from nnx_spmd_trainer.data.packing import LOSS_WEIGHTS, Row
from nnx_spmd_trainer.data_shard import DataShard

__all__ = ["BlockLayout", "PackedBlocks", "PackedBlocksIterator", "first_fit"]

_CACHED_LAYOUTS = 8  # blocks whose layout is kept: a step's rows span a few at most


def first_fit(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """Items ``0, 1, ...`` put in order into bins of ``capacity``: each into the first bin
    with room for it, else a new bin. Returns each bin's items.

    >>> first_fit([3, 2, 1, 4, 1], 4)
    [[0, 2], [1, 4], [3]]
    """
    free = np.zeros(len(sizes), np.int64)  # room left in each bin opened so far
    bins: list[list[int]] = []
    for item, size in enumerate(sizes):
        if not 0 < size <= capacity:
            raise ValueError(f"item {item} of size {size} does not fit a bin of {capacity}.")
        # a full item opens a bin: no bin has all its room
        fits: Any = np.flatnonzero(free[: len(bins)] >= size) if size < capacity else ()
        if len(fits):
            first = int(fits[0])
            free[first] -= size
            bins[first].append(item)
        else:
            free[len(bins)] = capacity - size
            bins.append([item])
    return bins


class BlockLayout(NamedTuple):
    """Where a block's chunks go: chunk ``c`` is pairs ``[start[c], start[c] + length[c])``
    of document ``document[c]`` (an index into the source); ``rows[r]`` lists the chunks
    of the block's row ``r`` in order (after the block's row shuffle)."""

    document: np.ndarray
    start: np.ndarray
    length: np.ndarray
    rows: list[list[int]]


class PackedBlocks(grain.IterDataset):  # type: ignore[type-arg]
    """Batches of this process's rows of documents packed block by block (the module's
    docstring): the global rows depend on the documents, ``seq_len``, ``seed`` and
    ``block_documents``, never on the process count.

    Args:
      documents: a random-access source of documents: ``int`` id arrays, or (``weighted``)
        ``{"ids", "loss_weights"}``. A source with ``span(i)`` and ``read(start, end)``
        (a ``Corpus``) is read at each chunk's tokens only.
      seq_len: tokens per row.
      global_batch_size: rows per step over all processes.
      shard: which rows this process feeds (``trainer.placement.data_shard``).
      seed: the documents' order each epoch and each block's row order; ``None``: the
        documents in source order, the rows as packed.
      block_documents: documents packed together; more, less padding.
      packed: ``False``: one chunk a row, padded (the baseline packing is measured against).
      weighted: documents carry per-token ``loss_weights``; rows carry them too.
      repeat: epochs without end; ``False``: one epoch, its last partial batch dropped.

    >>> docs = [np.arange(n) for n in (7, 3, 12, 5)]
    >>> one = PackedBlocks(docs, 4, global_batch_size=4, seed=1)
    >>> halves = [PackedBlocks(docs, 4, global_batch_size=4, shard=(i, 2), seed=1) for i in (0, 1)]
    >>> whole, (a, b) = next(iter(one)), [next(iter(h)) for h in halves]
    >>> bool((whole["inputs"] == np.concatenate([a["inputs"], b["inputs"]])).all())
    True
    """

    def __init__(
        self,
        documents: Any,
        seq_len: int,
        global_batch_size: int,
        shard: DataShard | tuple[int, int] = (0, 1),
        *,
        seed: int | None = 0,
        block_documents: int = 256,
        packed: bool = True,
        weighted: bool = False,
        repeat: bool = True,
    ) -> None:
        super().__init__()
        index, count = shard
        if seq_len < 1 or block_documents < 1:
            raise ValueError(
                f"seq_len ({seq_len}) and block_documents ({block_documents}) must be positive."
            )
        if global_batch_size % count:
            raise ValueError(
                f"A global batch of {global_batch_size} rows cannot be split between "
                f"{count} processes; use a multiple of {count}."
            )
        if len(documents) == 0:
            raise ValueError("PackedBlocks needs at least one document.")
        self.documents, self.seq_len, self.global_batch_size = documents, seq_len, global_batch_size
        self.shard, self.seed, self.block_documents = DataShard(index, count), seed, block_documents
        self.packed, self.weighted, self.repeat = packed, weighted, repeat
        self.blocks_per_epoch = -(-len(documents) // block_documents)
        self._block_starts = [0]  # the first global row of each block laid out so far
        self._layouts: OrderedDict[int, BlockLayout] = OrderedDict()
        self._orders: OrderedDict[int, np.ndarray] = OrderedDict()

    # -- the layout: lengths only ------------------------------------------------------
    def _order(self, epoch: int) -> np.ndarray:
        """The documents of ``epoch`` in order."""
        if epoch not in self._orders:
            n = len(self.documents)
            order = (
                np.arange(n)
                if self.seed is None
                else np.random.default_rng((self.seed, epoch)).permutation(n)
            )
            self._orders[epoch] = order
            if len(self._orders) > 2:
                self._orders.popitem(last=False)
        return self._orders[epoch]

    def _length(self, document: int) -> int:
        source = self.documents
        if hasattr(source, "span"):
            start, end = source.span(document)
            return int(end - start)
        ids = source[document]
        return len(ids["ids"] if isinstance(ids, Mapping) else ids)

    def layout(self, block: int) -> BlockLayout:
        """Block ``block``'s chunks and rows (blocks counted over all epochs), from the
        documents' lengths alone."""
        if block in self._layouts:
            self._layouts.move_to_end(block)
            return self._layouts[block]
        epoch, within = divmod(block, self.blocks_per_epoch)
        documents = self._order(epoch)[within * self.block_documents :][: self.block_documents]
        chunk_document, chunk_start, chunk_length = [], [], []
        for document in documents.tolist():
            pairs = self._length(document) - 1
            for start in range(0, max(pairs, 0), self.seq_len):
                chunk_document.append(document)
                chunk_start.append(start)
                chunk_length.append(min(self.seq_len, pairs - start))
        if self.packed:
            rows = first_fit(chunk_length, self.seq_len)
        else:
            rows = [[c] for c in range(len(chunk_length))]
        if self.seed is not None:
            shuffle = np.random.default_rng((self.seed, epoch, within, 1)).permutation(len(rows))
            rows = [rows[r] for r in shuffle]
        layout = BlockLayout(
            np.array(chunk_document, np.int64),
            np.array(chunk_start, np.int64),
            np.array(chunk_length, np.int64),
            rows,
        )
        self._layouts[block] = layout
        if len(self._layouts) > _CACHED_LAYOUTS:
            self._layouts.popitem(last=False)
        return layout

    def _locate(self, row: int) -> tuple[int, int]:
        """``(block, row within it)`` of global row ``row``."""
        while self._block_starts[-1] <= row:
            block = len(self._block_starts) - 1
            if not self.repeat and block >= self.blocks_per_epoch:
                raise IndexError(f"row {row} of an epoch of {self._block_starts[-1]} rows")
            self._block_starts.append(self._block_starts[-1] + len(self.layout(block).rows))
        block = bisect.bisect_right(self._block_starts, row) - 1
        return block, row - self._block_starts[block]

    def rows_in_epoch(self, epoch: int) -> int:
        """How many rows epoch ``epoch``'s documents pack into."""
        blocks = range(epoch * self.blocks_per_epoch, (epoch + 1) * self.blocks_per_epoch)
        return sum(len(self.layout(b).rows) for b in blocks)

    def __len__(self) -> int:
        """Full global batches in an epoch (``repeat=False``: all there are)."""
        return self.rows_in_epoch(0) // self.global_batch_size

    # -- the rows: tokens read ---------------------------------------------------------
    def _tokens(self, document: int, start: int, stop: int) -> tuple[np.ndarray, Any]:
        """Ids ``[start, stop)`` of a document, and their loss weights (weighted sources)."""
        source = self.documents
        if hasattr(source, "span") and hasattr(source, "read") and not self.weighted:
            first = source.span(document)[0]
            return source.read(first + start, first + stop, f"Document {document}"), None
        item = source[document]
        if self.weighted:
            ids, weights = item["ids"], np.asarray(item[LOSS_WEIGHTS], np.float32)
            return np.asarray(ids[start:stop], np.int32), weights[start:stop]
        return np.asarray(item[start:stop], np.int32), None

    def row(self, index: int) -> Row:
        """Global row ``index`` (the same on every process count)."""
        block, within = self._locate(index)
        layout = self.layout(block)
        row: Row = {key: np.zeros(self.seq_len, np.int32) for key in ("inputs", "targets")}
        segment_ids = np.zeros(self.seq_len, np.int32)
        positions = np.zeros(self.seq_len, np.int32)
        weights = np.zeros(self.seq_len, np.float32)
        at = 0
        for segment, chunk in enumerate(layout.rows[within], start=1):
            start, length = int(layout.start[chunk]), int(layout.length[chunk])
            ids, loss_weights = self._tokens(int(layout.document[chunk]), start, start + length + 1)
            row["inputs"][at : at + length] = ids[:-1]
            row["targets"][at : at + length] = ids[1:]
            segment_ids[at : at + length] = segment
            positions[at : at + length] = np.arange(length)
            if loss_weights is not None:
                weights[at : at + length] = loss_weights[1:]  # the weight of each target
            at += length
        row.update(
            segment_ids=segment_ids, positions=positions, target_segment_ids=segment_ids.copy()
        )
        if self.weighted:
            row[LOSS_WEIGHTS] = weights
        return row

    def global_rows(self, step: int) -> range:
        """The global rows this process feeds at ``step``."""
        per_process = self.global_batch_size // self.shard.count
        first = step * self.global_batch_size + self.shard.index * per_process
        return range(first, first + per_process)

    def batch(self, step: int) -> Row:
        """This process's batch at ``step``: its rows stacked."""
        # the global batch's last row first: every process stops at the same step
        self._locate((step + 1) * self.global_batch_size - 1)
        rows = [self.row(r) for r in self.global_rows(step)]
        return {key: np.stack([row[key] for row in rows]) for key in rows[0]}

    def __iter__(self) -> PackedBlocksIterator:
        return PackedBlocksIterator(self)

    def __str__(self) -> str:
        return (
            f"PackedBlocks(documents={len(self.documents)}, seq_len={self.seq_len}, "
            f"block_documents={self.block_documents}, shard={tuple(self.shard)})"
        )


class PackedBlocksIterator(grain.DatasetIterator):  # type: ignore[type-arg]
    """``PackedBlocks``' batches from a step on; its position is ``{"next_index": step}``,
    set on any process count."""

    def __init__(self, blocks: PackedBlocks) -> None:
        super().__init__()
        self._blocks = blocks
        self._step = 0

    def __next__(self) -> Row:
        try:
            batch = self._blocks.batch(self._step)
        except IndexError:  # one epoch (repeat=False) read to its last full batch
            raise StopIteration from None
        self._step += 1
        return batch

    def get_state(self) -> dict[str, Any]:
        return {"next_index": self._step}

    def set_state(self, state: dict[str, Any]) -> None:
        self._step = int(state["next_index"])
