"""data.packing: Grain's packers wrapped into rows with segment ids and positions."""

from __future__ import annotations

import json
from collections import Counter
from pydoc_data.topics import topics

import grain
import jax.numpy as jnp
import numpy as np
import pytest

from nnx_spmd_trainer.data.corpus import Corpus, write_corpus
from nnx_spmd_trainer.data.mixture import Mixture
from nnx_spmd_trainer.data.packing import (
    ROW_KEYS,
    ContiguousRows,
    pack_documents,
    packed_pipeline,
    padding_share,
    split_document,
)
from nnx_spmd_trainer.data.position import DataPosition, seek
from nnx_spmd_trainer.data.tokenizer import train_bpe
from nnx_spmd_trainer.nn.packed import target_weights

SEQ_LEN = 16


def documents(count: int = 60, seed: int = 0) -> list[np.ndarray]:
    """Documents of unequal lengths (2 to 40 ids, some longer than a row), every id
    unique, so a pair tells which document and place it came from."""
    lengths = np.random.default_rng(seed).integers(2, 41, size=count)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    return [np.arange(s, s + n, dtype=np.int32) for s, n in zip(starts, lengths, strict=False)]


def segments(row: dict[str, np.ndarray]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The (inputs, targets) of each segment of a row, after checking its ids and positions."""
    ids = row["segment_ids"]
    used = int((ids > 0).sum())
    assert (ids[used:] == 0).all(), "padding only at the end"
    found = []
    for segment in range(1, int(ids.max(initial=0)) + 1):
        where = np.flatnonzero(ids == segment)
        assert len(where) and (np.diff(where) == 1).all(), "a segment is contiguous"
        assert (row["positions"][where] == np.arange(len(where))).all(), "positions restart"
        found.append((tuple(row["inputs"][where].tolist()), tuple(row["targets"][where].tolist())))
    assert sorted(set(ids[:used].tolist())) == list(range(1, len(found) + 1))
    return found


def test_split_document_keeps_every_target_once() -> None:
    chunks = split_document(np.arange(20), 8)
    assert [len(c["inputs"]) for c in chunks] == [8, 8, 3]
    assert chunks[1]["inputs"][0] == 8 and chunks[1]["targets"][0] == 9  # continued, no gap
    targets = np.concatenate([c["targets"] for c in chunks])
    assert (targets == np.arange(1, 20)).all()
    assert split_document(np.array([5]), 8) == []  # one id: nothing to predict


@pytest.mark.parametrize("best_fit", [False, True])
def test_rows_hold_every_pair_once_with_segments_and_positions(best_fit: bool) -> None:
    docs = documents()
    ds = grain.MapDataset.source(docs)
    rows = list(pack_documents(ds, SEQ_LEN, num_packing_bins=4, best_fit=best_fit))
    assert all(set(row) == set(ROW_KEYS) for row in rows)
    assert all(
        row[k].shape == (SEQ_LEN,) and row[k].dtype == np.int32 for row in rows for k in ROW_KEYS
    )
    packed = Counter(seg for row in rows for seg in segments(row))
    expected = Counter(
        (tuple(c["inputs"].tolist()), tuple(c["targets"].tolist()))
        for doc in docs
        for c in split_document(doc, SEQ_LEN)
    )
    assert packed == expected  # each chunk of each document once, whole, in one segment
    # targets never cross documents: a target is its input's successor in the same document
    for row in rows:
        real = row["segment_ids"] > 0
        assert (row["targets"][real] == row["inputs"][real] + 1).all()
    assert any(int(row["segment_ids"].max()) >= 3 for row in rows)  # rows do hold several
    # the library's loss trains every real pair of these rows: none across documents to skip
    weights = np.asarray(
        target_weights({k: jnp.asarray(np.stack([r[k] for r in rows])) for k in ROW_KEYS})
    )
    assert weights.sum() == sum(
        len(c["inputs"]) for doc in docs for c in split_document(doc, SEQ_LEN)
    )


def test_packing_pads_less_than_one_document_a_row() -> None:
    ds = grain.MapDataset.source(documents(200))
    packed = np.stack([r["segment_ids"] for r in pack_documents(ds, SEQ_LEN, num_packing_bins=8)])
    unpacked = np.stack([r["segment_ids"] for r in pack_documents(ds, SEQ_LEN, packed=False)])
    assert (unpacked.max(axis=1) == 1).all()  # one segment a row
    # measured: 0.078 packed (288 rows) against 0.282 unpacked (370 rows)
    assert padding_share(packed) < 0.1 < 0.25 < padding_share(unpacked)
    assert (packed > 0).sum() == (unpacked > 0).sum()  # the same tokens, in fewer rows


def test_a_packed_pipeline_resumes_from_its_saved_position() -> None:
    docs = documents(300, seed=1)
    batches = iter(packed_pipeline(docs, SEQ_LEN, 4, seed=3))
    for _ in range(5):
        next(batches)
    state = json.loads(json.dumps(batches.get_state()))  # as a checkpoint stores it
    expected = [next(batches) for _ in range(4)]
    resumed = iter(packed_pipeline(docs, SEQ_LEN, 4, seed=3))
    assert seek(resumed, DataPosition(epoch=0, batches=5, state=state)) == 5
    for want in expected:
        got = next(resumed)
        assert all(np.array_equal(got[k], want[k]) for k in ROW_KEYS)
        assert got["inputs"].shape == (4, SEQ_LEN)


def test_processes_pack_their_own_documents() -> None:
    docs = documents(100, seed=2)
    seen = []
    for index in range(2):
        rows = packed_pipeline(docs, SEQ_LEN, 4, (index, 2), repeat=False)
        seen.append({int(i) for batch in rows for i in batch["inputs"][batch["segment_ids"] > 0]})
    assert not seen[0] & seen[1]
    assert len(seen[0]) > 0.4 * (len(seen[0]) + len(seen[1]))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    texts = [topics[k] for k in sorted(topics)][:30]
    folder = tmp_path_factory.mktemp("contiguous")
    (folder / "docs.jsonl").write_text(
        "".join(json.dumps({"text": t[: 40 + 37 * i]}) + "\n" for i, t in enumerate(texts))
    )
    tokenizer = train_bpe(texts=texts, vocab_size=300)
    return write_corpus([folder / "docs.jsonl"], folder / "corpus", tokenizer, progress=False)


def test_contiguous_rows_hold_the_documents_pairs(corpus: Corpus) -> None:
    rows = ContiguousRows(corpus, SEQ_LEN)
    assert len(rows) == (corpus.n_tokens - 1) // SEQ_LEN
    covered = len(rows) * SEQ_LEN  # pairs j -> j + 1 for j below this
    want: Counter[tuple[int, int]] = Counter()
    for i in range(len(corpus)):
        start, end = corpus.span(i)
        ids = corpus[i]
        want.update(
            (int(a), int(b))
            for j, (a, b) in enumerate(zip(ids[:-1], ids[1:], strict=True))
            if start + j < covered
        )
    got: Counter[tuple[int, int]] = Counter()
    for r in range(len(rows)):
        row = rows[r]
        for inputs, targets in segments_anywhere(row):
            got.update(zip(inputs, targets, strict=True))
    assert got == want  # every pair inside a document once; none across documents
    batch = {k: jnp.asarray(np.stack([rows[r][k] for r in range(len(rows))])) for k in ROW_KEYS}
    assert int(np.asarray(target_weights(batch)).sum()) == sum(want.values())
    # a document continued into the next row starts a segment at position 0 there
    # a range of documents: its rows are the same cuts from its first token on
    part = ContiguousRows(corpus, SEQ_LEN, (3, 9))
    first, end = corpus.span(3)[0], corpus.span(8)[1]
    assert len(part) == (end - first - 1) // SEQ_LEN
    assert np.array_equal(part[0]["inputs"], corpus.read(first, first + SEQ_LEN))
    assert np.array_equal(
        part[len(part) - 1]["targets"][-1:],
        corpus.read(first + len(part) * SEQ_LEN, first + len(part) * SEQ_LEN + 1),
    )
    with pytest.raises(ValueError, match="documents 5:5"):
        ContiguousRows(corpus, SEQ_LEN, (5, 5))
    continued = [
        r
        for r in range(1, len(rows))
        if rows[r]["segment_ids"][0] and rows[r - 1]["segment_ids"][-1]
    ]
    assert continued and all(rows[r]["positions"][0] == 0 for r in continued)


def segments_anywhere(row: dict[str, np.ndarray]) -> list[tuple[list[int], list[int]]]:
    """Like ``segments``, where segment 0 (a pair across documents) may sit mid-row."""
    out = []
    for segment in range(1, int(row["segment_ids"].max()) + 1):
        where = np.flatnonzero(row["segment_ids"] == segment)
        assert len(where) and (np.diff(where) == 1).all()
        assert (row["positions"][where] == np.arange(len(where))).all()
        out.append((row["inputs"][where].tolist(), row["targets"][where].tolist()))
    return out


def test_a_mixture_of_contiguous_rows_batches_them(corpus: Corpus) -> None:
    sources = {"x": ContiguousRows(corpus, SEQ_LEN), "y": ContiguousRows(corpus, SEQ_LEN)}
    batch = next(iter(Mixture(sources, {"x": 1, "y": 3}, global_batch_size=8, shard=(1, 2))))
    assert {k: v.shape for k, v in batch.items()} == {k: (4, SEQ_LEN) for k in ROW_KEYS}
    assert (batch["segment_ids"] > 0).mean() > 0.9  # a boundary pair a document: little lost
