"""data.packed_blocks: the same global rows on any process count, each process reading its
share, resumed from the step alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_corpus import paragraphs

from nnx_spmd_trainer.data import Corpus, PackedBlocks, train_bpe, write_corpus
from nnx_spmd_trainer.data.packing import ROW_KEYS, split_document

SEQ_LEN, BATCH = 16, 8


def unique_documents(count: int = 60, seed: int = 0) -> list[np.ndarray]:
    """Documents of unequal lengths (1 to 70 ids) whose ids are unique across them, so a
    pair names the document and place it came from."""
    lengths = np.random.default_rng(seed).integers(1, 70, count)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    return [np.arange(s, s + n, dtype=np.int32) for s, n in zip(starts, lengths, strict=False)]


def shares(documents, processes: int, steps: int, **options) -> list[dict[str, np.ndarray]]:
    """Each step's batches of ``processes`` simulated processes, laid side by side."""
    iterators = [
        iter(PackedBlocks(documents, SEQ_LEN, BATCH, (i, processes), **options))
        for i in range(processes)
    ]
    batches = []
    for _ in range(steps):
        parts = [next(it) for it in iterators]
        batches.append({k: np.concatenate([p[k] for p in parts]) for k in parts[0]})
    return batches


@pytest.mark.parametrize("options", [{}, {"block_documents": 7, "seed": 5}, {"packed": False}])
def test_the_rows_of_one_process_are_those_of_two_and_four_in_order(options) -> None:
    documents = unique_documents()
    steps = 30  # more than an epoch of blocks (60 documents, 7 a block: 9 blocks an epoch)
    one = shares(documents, 1, steps, **options)
    assert sorted(one[0]) == sorted(ROW_KEYS)
    for processes in (2, 4):
        for step, (a, b) in enumerate(
            zip(one, shares(documents, processes, steps, **options), strict=True)
        ):
            for key in a:
                np.testing.assert_array_equal(a[key], b[key], err_msg=f"{key} at step {step}")


def pairs_of(rows: list[dict[str, np.ndarray]]) -> list[tuple[int, int]]:
    pairs = []
    for row in rows:
        trained = row["segment_ids"] > 0
        pairs += list(
            zip(row["inputs"][trained].tolist(), row["targets"][trained].tolist(), strict=True)
        )
    return pairs


@pytest.mark.parametrize("block_documents", [1, 7, 256])
def test_every_pair_of_every_document_is_in_one_row_once_an_epoch(block_documents) -> None:
    documents = unique_documents()
    blocks = PackedBlocks(documents, SEQ_LEN, BATCH, block_documents=block_documents, seed=2)
    rows = [blocks.row(r) for r in range(blocks.rows_in_epoch(0))]
    expected = [(int(x), int(x) + 1) for d in documents for x in d[:-1]]
    found = pairs_of(rows)
    assert len(found) == len(expected) and sorted(found) == sorted(expected)
    for row in rows:  # each segment is one chunk of split_document, its positions from 0
        for segment in np.unique(row["segment_ids"][row["segment_ids"] > 0]):
            at = row["segment_ids"] == segment
            assert row["positions"][at].tolist() == list(range(int(at.sum())))
            first = int(row["inputs"][at][0])
            (document,) = [d for d in documents if d[0] <= first <= d[-1]]
            chunks = split_document(document, SEQ_LEN)
            assert any(np.array_equal(c["inputs"], row["inputs"][at]) for c in chunks)
        np.testing.assert_array_equal(row["target_segment_ids"], row["segment_ids"])
    # first-fit over a block: fewer rows than one chunk a row, and the same pairs
    unpacked = PackedBlocks(documents, SEQ_LEN, BATCH, block_documents=block_documents, seed=2,
                            packed=False)  # fmt: skip
    assert unpacked.rows_in_epoch(0) > len(rows) or block_documents == 1
    assert sorted(pairs_of([unpacked.row(r) for r in range(unpacked.rows_in_epoch(0))])) == sorted(
        expected
    )


def test_weighted_documents_carry_their_target_weights() -> None:
    rng = np.random.default_rng(1)
    documents = [
        {"ids": d, "loss_weights": rng.integers(0, 2, len(d)).astype(np.float32)}
        for d in unique_documents(30)
    ]
    weight_of = {
        int(x): float(w)
        for d in documents
        for x, w in zip(d["ids"], d["loss_weights"], strict=True)
    }
    one = shares(documents, 1, 6, weighted=True, block_documents=5)
    two = shares(documents, 2, 6, weighted=True, block_documents=5)
    for a, b in zip(one, two, strict=True):
        np.testing.assert_array_equal(a["loss_weights"], b["loss_weights"])
        assert a["loss_weights"].dtype == np.float32
        trained = a["segment_ids"] > 0
        expected = [weight_of[int(t)] for t in a["targets"][trained]]  # the target's weight
        assert a["loss_weights"][trained].tolist() == expected
        assert not a["loss_weights"][~trained].any()  # padding is never trained


def test_a_run_resumed_at_a_step_on_another_process_count_takes_the_same_rows() -> None:
    documents = unique_documents()
    whole = shares(documents, 1, 12, block_documents=7)
    for processes in (1, 2, 4):
        iterators = []
        for i in range(processes):
            it = iter(PackedBlocks(documents, SEQ_LEN, BATCH, (i, processes), block_documents=7))
            it.set_state({"next_index": 5})  # the state a checkpoint saves: the step alone
            iterators.append(it)
        for step in range(5, 12):
            parts = [next(it) for it in iterators]
            inputs = np.concatenate([p["inputs"] for p in parts])
            np.testing.assert_array_equal(inputs, whole[step]["inputs"])
        assert iterators[0].get_state() == {"next_index": 12}


def test_one_epoch_ends_on_every_process_at_the_same_batch() -> None:
    documents = unique_documents()
    counts = []
    for processes in (1, 2, 4):
        for i in range(processes):
            blocks = PackedBlocks(documents, SEQ_LEN, BATCH, (i, processes), repeat=False)
            counts.append(sum(1 for _ in blocks))
    assert len(set(counts)) == 1 and counts[0] == len(blocks) > 0


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    texts = paragraphs()[:600]
    folder = tmp_path_factory.mktemp("inputs")
    for number, text in enumerate(texts):
        (folder / f"{number:04d}.txt").write_text(text)
    tokenizer = train_bpe(texts=texts, vocab_size=300)
    return write_corpus([folder], tmp_path_factory.mktemp("corpus"), tokenizer, progress=False)


@pytest.mark.parametrize("processes", [2, 4])
def test_each_process_reads_about_its_share_of_the_corpus_bytes(
    corpus: Corpus, processes: int
) -> None:
    total = corpus.n_tokens * corpus.dtype.itemsize
    read, batches = [], []
    for index in range(processes):
        own = Corpus(Path(corpus.directory))  # each process maps the corpus itself
        batches.append(list(PackedBlocks(own, 64, 16, (index, processes), repeat=False)))
        read.append(own.bytes_read / total)
    # a chunk is read at its span (a document cut between rows costs one token more); the
    # epoch's last partial batch is not read
    assert read == pytest.approx([1 / processes] * processes, abs=0.03), read
    assert sum(read) == pytest.approx(1.0, abs=0.02)
    whole = list(PackedBlocks(Corpus(Path(corpus.directory)), 64, 16, repeat=False))
    for step, batch in enumerate(whole):
        inputs = np.concatenate([b[step]["inputs"] for b in batches])
        np.testing.assert_array_equal(inputs, batch["inputs"])


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="cannot be split between 3 processes"):
        PackedBlocks(unique_documents(), SEQ_LEN, BATCH, (0, 3))
    with pytest.raises(ValueError, match="at least one document"):
        PackedBlocks([], SEQ_LEN, BATCH)
