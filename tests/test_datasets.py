"""Character dataset, tokenizer, Grain batching, baselines, synthetic tasks."""

import itertools

import numpy as np
import pytest

from nnx_spmd_trainer import grain_pipeline
from nnx_spmd_trainer.app import datasets
from nnx_spmd_trainer.app.datasets.base import index_batches


@pytest.fixture(scope="module")
def corpus():
    text = datasets.load_text()
    return text, datasets.CharTokenizer(text)


def take(iterable, n):
    return list(itertools.islice(iter(iterable), n))


def test_load_text_is_the_pydoc_topics_in_key_order():
    from pydoc_data.topics import topics

    text = datasets.load_text()
    first = sorted(topics)[0]
    assert text.startswith(topics[first])
    assert len(text) == sum(map(len, topics.values())) > 100_000


def test_tokenizer_round_trips_the_corpus(corpus):
    text, tokenizer = corpus
    ids = tokenizer.encode(text)
    assert ids.dtype == np.int32 and ids.shape == (len(text),)
    assert tokenizer.decode(ids) == text
    assert ids.max() == tokenizer.num_chars - 1


def test_tokenizer_pads_vocab_to_a_multiple_of_8():
    tokenizer = datasets.CharTokenizer("abcdefghij")  # 10 characters
    assert (tokenizer.num_chars, tokenizer.vocab_size) == (10, 16)
    assert datasets.CharTokenizer("abcdefgh").vocab_size == 8
    assert datasets.CharTokenizer("abc", pad_to_multiple_of=4).vocab_size == 4
    assert tokenizer.decode([0, 12, 15, 1]) == "ab"  # padding ids decode to nothing


def test_tokenizer_rejects_unknown_characters():
    with pytest.raises(ValueError, match=r"\['z'\]"):
        datasets.CharTokenizer("abc").encode("abz")


def test_split_holds_out_the_end():
    tokens = np.arange(100)
    train, held_out = datasets.split_tokens(tokens, 0.1)
    np.testing.assert_array_equal(train, np.arange(90))
    np.testing.assert_array_equal(held_out, np.arange(90, 100))


def test_train_batches_shapes_dtypes_and_shifted_targets(corpus):
    text, tokenizer = corpus
    tokens = tokenizer.encode(text)
    batch = take(datasets.train_batches(tokens, seq_len=32, batch_size=8, seed=0), 1)[0]
    assert set(batch) == {"inputs", "targets"}
    for value in batch.values():
        assert value.dtype == np.int32 and value.shape == (8, 32)
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    for row_inputs, row_targets in zip(batch["inputs"], batch["targets"], strict=True):
        window = tokenizer.decode(row_inputs) + tokenizer.decode(row_targets[-1:])
        assert window in text  # a contiguous window of the text


def test_train_batches_are_deterministic_per_seed(corpus):
    text, tokenizer = corpus
    tokens = tokenizer.encode(text)
    make = lambda seed: take(datasets.train_batches(tokens, seq_len=16, batch_size=4, seed=seed), 3)
    first, again, other = make(1), make(1), make(2)
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a["inputs"], b["inputs"])
    assert not np.array_equal(first[0]["inputs"], other[0]["inputs"])


def test_train_stream_is_endless_and_reshuffles_each_epoch():
    tokens = np.arange(13, dtype=np.int32)  # 12 windows of length 1
    batches = take(datasets.train_batches(tokens, seq_len=1, batch_size=4, seed=0), 9)
    starts = np.concatenate([b["inputs"][:, 0] for b in batches])
    epochs = starts.reshape(3, 12)
    for epoch in epochs:
        assert sorted(epoch) == list(range(12))  # every window once per epoch
    assert not np.array_equal(epochs[0], epochs[1])


def test_eval_batches_are_fixed_consecutive_windows_and_reiterable():
    tokens = np.arange(1000, dtype=np.int32)
    held_out = datasets.eval_batches(tokens, seq_len=10, batch_size=4, max_batches=3)
    first, second = list(held_out), list(held_out)
    assert len(first) == 3
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a["inputs"], b["inputs"])
    np.testing.assert_array_equal(first[0]["inputs"][1], np.arange(10, 20))
    np.testing.assert_array_equal(first[0]["targets"][1], np.arange(11, 21))
    assert len(list(datasets.eval_batches(tokens, seq_len=10, batch_size=4))) == 24  # 99 // 4


def test_eval_shards_split_the_windows_between_processes():
    tokens = np.arange(81, dtype=np.int32)  # 8 windows of 10
    starts = [
        np.concatenate(
            [
                b["inputs"][:, 0]
                for b in datasets.eval_batches(tokens, seq_len=10, batch_size=2, shard=(i, 2))
            ]
        )
        for i in range(2)
    ]
    assert sorted(np.concatenate(starts)) == list(range(0, 80, 10))
    assert not set(starts[0]) & set(starts[1])


def test_too_little_text_fails_clearly():
    with pytest.raises(ValueError, match="fewer than one batch"):
        datasets.eval_batches(np.arange(20, dtype=np.int32), seq_len=10, batch_size=4)


def test_unigram_baseline_matches_numpy():
    rng = np.random.default_rng(0)
    train = rng.integers(0, 7, size=1000)
    held_out = rng.integers(0, 8, size=300)  # id 7 never seen in training
    counts = np.bincount(train, minlength=8) + 1.0
    expected = -np.mean(np.log(counts[held_out] / counts.sum()))
    assert datasets.unigram_baseline(train, held_out) == pytest.approx(expected, rel=1e-12)
    # unsmoothed, on the training text itself it is the entropy of the frequencies
    p = np.bincount(train) / len(train)
    entropy = -np.sum(p * np.log(p))
    assert datasets.unigram_baseline(train, train, alpha=0.0) == pytest.approx(entropy)


def test_char_lm_splits_baseline_scores_the_evaluated_targets():
    tokenizer, splits = datasets.char_lm_splits(
        seq_len=64, batch_size=8, seed=0, max_eval_batches=2
    )
    targets = np.concatenate([b["targets"].ravel() for b in splits.eval])
    text = datasets.load_text()
    train, _ = datasets.split_tokens(tokenizer.encode(text), 0.1)
    expected = datasets.unigram_baseline(train, targets, vocab_size=tokenizer.vocab_size)
    assert splits.baseline == pytest.approx(expected)
    assert 3.0 < splits.baseline < 3.6  # about ln(25): a model must beat it to have learnt
    assert splits.baseline_name == "unigram baseline"


def test_classification_task_is_learnable_and_balanced_enough():
    splits = datasets.classification_splits(num_features=8, num_classes=4, batch_size=32, seed=0)
    batch = take(splits.train, 1)[0]
    assert batch["inputs"].shape == (32, 8) and batch["inputs"].dtype == np.float32
    assert batch["labels"].dtype == np.int32 and set(batch["labels"]) <= set(range(4))
    assert np.log(4) - 0.3 < splits.baseline < np.log(4) + 0.05
    assert len(list(splits.eval)) == 1024 // 32


def test_images_encode_the_class_in_the_bar_orientation():
    images, labels = datasets.synthetic.make_images(64, 12, 4, seed=0)
    assert images.shape == (64, 12, 12, 1) and images.dtype == np.float32
    splits = datasets.image_splits(image_size=12, num_classes=4, batch_size=16, seed=0)
    assert take(splits.train, 1)[0]["inputs"].shape == (16, 12, 12, 1)


def test_index_batches_rejects_a_bad_shard():
    with pytest.raises(ValueError, match="shard"):
        datasets.index_batches(10, 2, lambda i: {"i": i}, shard=(2, 2))


def test_index_batches_reshuffle_each_epoch_and_cover_every_example():
    pipeline = index_batches(12, 4, lambda i: {"i": i}, seed=3, repeat=True)
    epochs = np.concatenate([pipeline[k]["i"] for k in range(9)]).reshape(3, 12)
    for epoch in epochs:
        assert sorted(epoch) == list(range(12))
    assert len({tuple(epoch) for epoch in epochs}) == 3  # a new permutation each epoch


def test_grain_pipeline_splits_each_global_batch_between_the_processes():
    whole = grain_pipeline(48, 8, (0, 1), seed=1)
    halves = [grain_pipeline(48, 8, (i, 2), seed=1) for i in range(2)]
    for step in range(12):  # two epochs: the same examples per step, whatever the count
        both = np.concatenate([half[step] for half in halves])
        assert len(halves[0][step]) == 4 and sorted(whole[step]) == sorted(both)
    with pytest.raises(ValueError, match="cannot be split between the 3 processes"):
        grain_pipeline(48, 8, (0, 3))
    records = grain_pipeline(["a", "b", "c", "d"], 2, seed=None, repeat=False, map_fn=str.upper)
    assert [list(batch) for batch in records] == [["A", "B"], ["C", "D"]]
