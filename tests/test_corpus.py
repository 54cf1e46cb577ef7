"""data.corpus: a tokenized corpus written (and resumed), checked, and read per process."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path
from pydoc_data.topics import topics

import numpy as np
import pytest

from nnx_spmd_trainer.data.corpus import (
    CHUNK_RECORD,
    Corpus,
    CorpusError,
    token_dtype,
    write_corpus,
)
from nnx_spmd_trainer.data.packing import packed_pipeline
from nnx_spmd_trainer.data.tokenizer import Tokenizer, train_bpe
from nnx_spmd_trainer.data_shard import DataShard

FILES = ("header.json", "tokens.bin", "offsets.bin", "chunks.bin", "tokenizer.json")


def paragraphs() -> list[str]:
    """The pydoc topics cut at blank lines: 2,608 documents of unequal lengths."""
    return [p for key in sorted(topics) for p in topics[key].split("\n\n") if p.strip()]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return train_bpe(texts=[topics[k] for k in sorted(topics)], vocab_size=512)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """A JSONL file of paragraphs (one document a line) and two plain text files."""
    folder = tmp_path_factory.mktemp("inputs")
    jsonl = folder / "paragraphs.jsonl"
    jsonl.write_text(
        "".join(json.dumps({"text": p, "id": i}) + "\n" for i, p in enumerate(paragraphs()))
    )
    (folder / "texts").mkdir()
    (folder / "texts" / "a.txt").write_text(topics["if"])
    (folder / "texts" / "b.txt").write_text(topics["while"])
    return [jsonl, folder / "texts"]


@pytest.fixture(scope="module")
def corpus(
    inputs: list[Path], tokenizer: Tokenizer, tmp_path_factory: pytest.TempPathFactory
) -> Corpus:
    out = tmp_path_factory.mktemp("corpus")
    return write_corpus(inputs, out, tokenizer, chunk_docs=500, progress=False)


def copy(corpus: Corpus, to: Path) -> Path:
    shutil.copytree(corpus.directory, to)
    return to


def test_each_document_reads_back_as_its_text(corpus: Corpus, tokenizer: Tokenizer) -> None:
    texts = [*paragraphs(), topics["if"], topics["while"]]
    assert len(corpus) == len(texts) and corpus.dtype == np.uint16
    for i in [0, 1, 17, len(texts) - 3, len(texts) - 2, len(texts) - 1]:
        ids = corpus[i]
        assert ids.dtype == np.int32 and ids[-1] == tokenizer.eos_id  # each document ends with EOS
        assert tokenizer.decode(ids) == texts[i]
    assert corpus.n_tokens == sum(len(corpus[i]) for i in range(len(corpus)))
    assert corpus.header["max_id"] == max(int(corpus[i].max()) for i in range(len(corpus)))
    assert corpus.header["n_chunks"] == -(-len(texts) // 500)
    assert corpus.tokenizer().sha256 == tokenizer.sha256  # saved beside the corpus
    corpus.verify()


def test_token_dtype_follows_the_vocabulary() -> None:
    assert token_dtype(50257) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32 and token_dtype(128256) == np.uint32


class StopAfter(Tokenizer):
    """The same tokenizer (same hash), stopped like a killed writer after ``chunks`` chunks."""

    def __init__(self, tokenizer: Tokenizer, chunks: int) -> None:
        super().__init__(tokenizer.backend)
        self.chunks = chunks

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:  # type: ignore[override]
        if self.chunks == 0:
            raise KeyboardInterrupt
        self.chunks -= 1
        return super().encode_batch(texts)


def test_a_stopped_write_resumes_to_the_same_bytes(
    corpus: Corpus, inputs: list[Path], tokenizer: Tokenizer, tmp_path: Path
) -> None:
    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        write_corpus(inputs, out, StopAfter(tokenizer, 3), chunk_docs=500, progress=False)
    header = json.loads((out / "header.json").read_text())
    assert (header["n_docs"], header["complete"]) == (1500, False)
    assert (out / "tokens.bin").stat().st_size == header["n_tokens"] * 2  # only what it names
    with pytest.raises(CorpusError, match="not written to the end"):
        Corpus(out)
    with (out / "tokens.bin").open("ab") as torn:  # a chunk stopped before its header
        torn.write(b"\x07" * 1001)
    resumed = write_corpus(inputs, out, tokenizer, chunk_docs=500, progress=False)
    for name in FILES:
        assert (out / name).read_bytes() == (corpus.directory / name).read_bytes(), name
    assert len(resumed) == len(corpus)


def test_a_resume_with_another_tokenizer_is_refused(
    corpus: Corpus, inputs: list[Path], tmp_path: Path
) -> None:
    other = train_bpe(texts=[topics["if"]] * 4, vocab_size=300)
    out = copy(corpus, tmp_path / "c")
    with pytest.raises(CorpusError, match="another tokenizer"):
        write_corpus(inputs, out, other, progress=False)


def test_a_truncated_file_is_named_with_its_offset(corpus: Corpus, tmp_path: Path) -> None:
    for name, keep in (("tokens.bin", 12345), ("offsets.bin", 800), ("chunks.bin", 30)):
        out = copy(corpus, tmp_path / name)
        with (out / name).open("r+b") as file:
            file.truncate(keep)
        with pytest.raises(CorpusError, match="truncated") as error:
            Corpus(out)
        assert f"{out / name} is truncated: it ends at byte offset {keep}" in str(error.value)


def test_a_damaged_chunk_is_named(corpus: Corpus, tmp_path: Path) -> None:
    out = copy(corpus, tmp_path / "damaged")
    chunk_0 = np.fromfile(corpus.directory / "chunks.bin", CHUNK_RECORD)[0]
    start_of_chunk_1 = int(chunk_0["n_tokens"]) * 2
    with (out / "tokens.bin").open("r+b") as file:
        file.seek(start_of_chunk_1 + 10)
        file.write(b"\x01\x01")
    with pytest.raises(CorpusError, match=f"chunk 1, from byte offset {start_of_chunk_1}"):
        Corpus(out).verify()


def test_ids_beyond_the_model_vocabulary_are_refused(corpus: Corpus, tmp_path: Path) -> None:
    largest = corpus.header["max_id"]
    with pytest.raises(CorpusError, match=f"ids up to {largest}.*vocabulary is {largest}"):
        Corpus(corpus.directory).check_vocab(largest)
    Corpus(corpus.directory).check_vocab(largest + 1)
    # an id the header does not know of (a file changed after writing) fails when read
    out = copy(corpus, tmp_path / "changed")
    with (out / "tokens.bin").open("r+b") as file:
        file.seek(2 * 3)
        file.write(np.array([largest + 7], np.uint16).tobytes())
    changed = Corpus(out)
    changed.check_vocab(largest + 1)
    with pytest.raises(CorpusError, match=f"Document 0 of {out} holds id {largest + 7}"):
        changed[0]
    assert len(changed[1])  # the other documents read


def test_each_of_two_processes_reads_about_half_the_bytes(corpus: Corpus) -> None:
    """Per-process reading, measured: the token bytes each process's packed pipeline slices
    from the memory map over one epoch (``Corpus.bytes_read``)."""
    total = corpus.n_tokens * corpus.dtype.itemsize
    shares = []
    for index in range(2):
        own = Corpus(corpus.directory)  # each process maps the corpus itself
        for _ in packed_pipeline(own, 64, 8, DataShard(index, 2), repeat=False):
            pass
        shares.append(own.bytes_read / total)
    # measured: 0.507 and 0.493 of the 433,152 bytes of tokens (219,640 and 213,512 bytes;
    # the documents' lengths differ, so the halves do a little); together, every byte once
    assert shares == pytest.approx([0.5, 0.5], abs=0.02), shares
    assert sum(shares) == pytest.approx(1.0, abs=1e-9)


def test_a_pickled_corpus_maps_its_files_again(corpus: Corpus) -> None:
    """Grain's worker processes get the source pickled: the path, not the tokens."""
    corpus[3]  # maps the files
    data = pickle.dumps(corpus)
    assert len(data) < 4096 < corpus.n_tokens * 2
    again = pickle.loads(data)
    assert np.array_equal(again[3], corpus[3]) and len(again) == len(corpus)


def test_a_jsonl_line_without_the_field_is_named(tokenizer: Tokenizer, tmp_path: Path) -> None:
    lines = tmp_path / "docs.jsonl"
    lines.write_text('{"text": "one"}\n\n{"body": "two"}\n')
    with pytest.raises(CorpusError, match=f"{lines} at byte 17: no field 'text'"):
        write_corpus([lines], tmp_path / "c", tokenizer, progress=False)


def test_a_damaged_last_offset_is_named_at_open(corpus: Corpus, tmp_path: Path) -> None:
    out = copy(corpus, tmp_path / "offsets")
    with (out / "offsets.bin").open("r+b") as file:
        file.seek(-8, 2)
        file.write(np.array([5], "<i8").tobytes())
    with pytest.raises(
        CorpusError, match="offsets.bin is damaged: its last document ends at token 5"
    ):
        Corpus(out)


def test_a_binary_file_is_named_and_the_corpus_begun_is_removed(
    tokenizer: Tokenizer, tmp_path: Path
) -> None:
    (tmp_path / "a.txt").write_text("hello there " * 50)
    (tmp_path / "b.gz").write_bytes(b"\x1f\x8b\x08\x00\x00")
    out = tmp_path / "c"
    with pytest.raises(CorpusError, match=r"b\.gz is not UTF-8 text \(byte 0x8b at offset 1\)"):
        write_corpus([tmp_path / "a.txt", tmp_path / "b.gz"], out, tokenizer, chunk_docs=1)
    assert not out.exists()  # the first file's chunk was written, then removed with the rest


def test_inputs_without_a_document_are_refused(tokenizer: Tokenizer, tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(CorpusError, match="no document"):
        write_corpus([tmp_path / "empty.jsonl"], tmp_path / "c", tokenizer, progress=False)
    with pytest.raises(CorpusError, match="No input files"):
        write_corpus([], tmp_path / "c", tokenizer, progress=False)
    assert not (tmp_path / "c").exists()
