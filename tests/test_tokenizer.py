"""data.tokenizer: a byte-level BPE trained here or loaded from a tokenizer.json."""

from __future__ import annotations

from pathlib import Path
from pydoc_data.topics import topics

import numpy as np
import pytest

from nnx_spmd_trainer.data.tokenizer import (
    EOS_TOKEN,
    Tokenizer,
    TokenizerError,
    load_tokenizer,
    train_bpe,
)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return train_bpe(texts=[topics[k] for k in sorted(topics)], vocab_size=512)


def test_round_trip_of_text_never_seen_in_training(tokenizer: Tokenizer) -> None:
    text = "Grüße, 世界! tabs\tand\nnewlines  and emoji 🙂 survive a byte-level BPE."
    ids = tokenizer.encode(text)
    assert ids.dtype == np.int32
    assert tokenizer.decode(ids) == text
    # merges were learnt: an English text of the training kind takes fewer ids than bytes
    sample = topics["if"]
    assert len(tokenizer.encode(sample)) < 0.6 * len(sample.encode())


def test_vocabulary_and_end_of_document(tokenizer: Tokenizer) -> None:
    assert tokenizer.vocab_size == 512
    eos = tokenizer.eos_id
    assert eos is not None and eos == tokenizer.backend.token_to_id(EOS_TOKEN)
    assert tokenizer.decode([eos]) == ""  # special: no text
    batch = tokenizer.encode_batch(["a b", "def f(): pass"])
    assert [b.tolist() for b in batch] == [
        tokenizer.encode(t).tolist() for t in ["a b", "def f(): pass"]
    ]


def test_saved_tokenizer_loads_the_same(tokenizer: Tokenizer, tmp_path: Path) -> None:
    path = tokenizer.save(tmp_path / "tok")
    assert path == tmp_path / "tok" / "tokenizer.json"
    for where in (path, path.parent):  # the file, or its folder
        loaded = load_tokenizer(where)
        assert loaded.sha256 == tokenizer.sha256
        assert loaded.eos_id == tokenizer.eos_id
        text = topics["while"]
        assert np.array_equal(loaded.encode(text), tokenizer.encode(text))


def test_training_is_deterministic(tokenizer: Tokenizer) -> None:
    again = train_bpe(texts=[topics[k] for k in sorted(topics)], vocab_size=512)
    assert again.sha256 == tokenizer.sha256


def test_a_tokenizer_file_that_does_not_load_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"version": "1.0", "model": {"type": "NoSuchModel"}}')
    with pytest.raises(TokenizerError, match="does not load") as error:
        load_tokenizer(bad)
    assert str(bad) in str(error.value) and "tokenizer.json written by" in str(error.value)
    with pytest.raises(TokenizerError, match="No tokenizer at") as error:
        load_tokenizer(tmp_path / "missing")
    assert str(tmp_path / "missing") in str(error.value)


def test_bad_training_arguments() -> None:
    with pytest.raises(ValueError, match="files or texts"):
        train_bpe()
    with pytest.raises(ValueError, match="256 byte tokens"):
        train_bpe(texts=["x"], vocab_size=100)


def test_training_on_files_and_folders(tokenizer: Tokenizer, tmp_path: Path) -> None:
    keys = sorted(topics)
    (tmp_path / "texts").mkdir()
    for i, key in enumerate(keys):
        (tmp_path / "texts" / f"{i:03d}.txt").write_text(topics[key])
    from_folder = train_bpe([tmp_path / "texts"], vocab_size=512)
    text = topics["for"]
    assert from_folder.decode(from_folder.encode(text)) == text
    assert len(from_folder.encode(text)) < 0.6 * len(text.encode())
