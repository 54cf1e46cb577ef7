"""What this process has read from corpora on disk, counted as ``Corpus.read`` reads it:
the per-process share of a corpus that ``nnx-spmd-train`` reports at the end of a run."""

from __future__ import annotations

import os
from collections import Counter

#: Token bytes read in this process, by corpus folder.
_READ_IN_PROCESS: Counter[str] = Counter()


def count_read(directory: str | os.PathLike[str], n_bytes: int) -> int:
    """Adds ``n_bytes`` read from the corpus in ``directory`` to this process's count;
    returns ``n_bytes``."""
    _READ_IN_PROCESS[os.fspath(directory)] += n_bytes
    return n_bytes


def bytes_read_in_process() -> dict[str, int]:
    """Token bytes this process has read from each corpus folder through every ``Corpus``
    it opened (a copy). Slices of ``Corpus.tokens`` taken directly (the unigram baseline's
    sample of each corpus) are not reads of ``Corpus.read`` and are not counted."""
    return dict(_READ_IN_PROCESS)
