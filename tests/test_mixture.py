"""data.mixture: weighted sources, stages, and a position that is the step alone."""

from __future__ import annotations

import numpy as np
import pytest

from nnx_spmd_trainer.data.mixture import Mixture, MixtureError, Stage
from nnx_spmd_trainer.data.position import BATCHES_TAKEN, DataPosition, seek

# each row names its source (row // 10000) and its place in it (row % 10000)
SOURCES = {
    "web": 0 + np.arange(1000),
    "code": 10000 + np.arange(300),
    "books": 20000 + np.arange(50),
}
WEIGHTS = {"web": 0.5, "code": 0.3, "books": 0.2}


def take(mixture: Mixture, steps: int) -> list[np.ndarray]:
    batches = iter(mixture)
    return [next(batches) for _ in range(steps)]


def global_batches(steps: int, count: int, **kwargs: object) -> np.ndarray:
    """The global batches ``count`` processes feed, put together: process ``i`` feeds the
    rows ``i, i + count, ...`` of each step."""
    per_process = [take(Mixture(SOURCES, shard=(i, count), **kwargs), steps) for i in range(count)]  # type: ignore[arg-type]
    out = np.zeros((steps, len(per_process[0][0]) * count), dtype=np.int64)
    for i, batches in enumerate(per_process):
        out[:, i::count] = np.stack(batches)
    return out


def test_proportions_within_two_percent_over_10k_rows() -> None:
    mixture = Mixture(SOURCES, WEIGHTS, global_batch_size=100)
    ids = np.concatenate([mixture.source_ids(step) for step in range(100)])
    assert len(ids) == 10_000
    shares = np.bincount(ids, minlength=3) / len(ids)
    for share, name in zip(shares, mixture.names, strict=True):
        assert abs(share - WEIGHTS[name]) < 0.02, (name, share)
    # the rows read are those of the sources named (row // 10000 tells a row's source)
    rows = np.concatenate(take(mixture, 5))
    assert np.array_equal(rows // 10000, ids[:500])
    # each source is read in its own shuffle, each row once an epoch: the 50 books rows
    # drawn first are the whole source, in another order
    books = rows[rows // 10000 == 2][:50]
    assert sorted(books.tolist()) == SOURCES["books"].tolist()
    assert books.tolist() != SOURCES["books"].tolist()


def test_the_stage_switch_comes_at_its_step() -> None:
    stages = [Stage(0, {"web": 1, "code": 0, "books": 0}), (37, {"web": 0, "code": 1, "books": 0})]
    batches = take(Mixture(SOURCES, stages, global_batch_size=8), 50)
    sources = [set((b // 10000).tolist()) for b in batches]
    assert sources[:37] == [{0}] * 37 and sources[37:] == [{1}] * 13
    # and the positions go on counting across the switch
    mixture = Mixture(SOURCES, stages, global_batch_size=8)
    assert mixture.positions(50) == {"web": 37 * 8, "code": 13 * 8, "books": 0}


def test_positions_are_the_counts_of_rows_taken() -> None:
    mixture = Mixture(SOURCES, WEIGHTS, global_batch_size=16, shard=(1, 2))
    batches = iter(mixture)
    for _ in range(23):
        next(batches)
    positions = batches.positions()
    assert positions == mixture.positions(23)  # replayed from the step alone
    assert sum(positions.values()) == 23 * 16  # every process counts the whole global batch
    ids = np.concatenate([mixture.source_ids(s) for s in range(23)])
    assert positions == {n: int((ids == i).sum()) for i, n in enumerate(mixture.names)}
    assert mixture.epochs(23)["books"] == pytest.approx(positions["books"] / 50)


STAGES = [(0, WEIGHTS), (30, {"web": 0.1, "code": 0.1, "books": 0.8})]


def test_a_run_stopped_mid_stage_resumes_bitwise_also_from_two_processes_to_one() -> None:
    options = {"weights": STAGES, "global_batch_size": 8, "seed": 5}
    two = global_batches(60, 2, **options)
    assert np.array_equal(two, global_batches(60, 1, **options))  # the same rows, any count
    # stopped at step 45 (mid-stage) with 2 processes; the same count resumes from its state,
    # and 1 process from the batches taken (what the library gives on another count)
    for count in (1, 2):
        resumed = []
        for index in range(count):
            batches = iter(Mixture(SOURCES, shard=(index, count), **options))  # type: ignore[arg-type]
            state = {"next_index": 45} if count == 2 else BATCHES_TAKEN
            assert seek(batches, DataPosition(epoch=0, batches=45, state=state)) == 45
            resumed.append(np.stack([next(batches) for _ in range(15)]))
        glued = np.zeros_like(two[45:])
        for index, part in enumerate(resumed):
            glued[:, index::count] = part
        assert np.array_equal(glued, two[45:]), count


def test_rows_that_are_dicts_are_batched_by_key() -> None:
    rows = {"a": [{"x": np.full(3, i), "y": np.int32(i)} for i in range(10)]}
    batch = next(iter(Mixture(rows, {"a": 1.0}, global_batch_size=4)))
    assert batch["x"].shape == (4, 3) and batch["y"].shape == (4,)
    assert (batch["x"][:, 0] == batch["y"]).all()


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ({"web": 1, "code": 1}, r"missing \['books'\]"),
        ({**WEIGHTS, "news": 1}, r"unknown \['news'\]"),
        ({**WEIGHTS, "code": -0.1}, "finite and non-negative"),
        ({**WEIGHTS, "code": float("nan")}, "finite and non-negative"),
        ({"web": 0, "code": 0, "books": 0}, "all zero"),
        ([(5, WEIGHTS)], "must start at step 0"),
        ([(0, WEIGHTS), (0, WEIGHTS)], "same step"),
    ],
)
def test_bad_weights_are_named(weights: object, message: str) -> None:
    with pytest.raises(MixtureError, match=message):
        Mixture(SOURCES, weights, global_batch_size=8)  # type: ignore[arg-type]


def test_an_empty_source_and_an_uneven_batch_are_refused() -> None:
    with pytest.raises(MixtureError, match="empty"):
        Mixture({**SOURCES, "none": []}, {**WEIGHTS, "none": 1}, global_batch_size=8)
    with pytest.raises(ValueError, match="multiple of 3"):
        Mixture(SOURCES, WEIGHTS, global_batch_size=8, shard=(0, 3))


def test_a_stage_the_run_never_reaches_is_refused_naming_it() -> None:
    stages = [(0, WEIGHTS), (100, {"web": 0.0, "code": 0.0, "books": 1.0})]
    with pytest.raises(MixtureError, match=r"stage from step 100 .* never starts.*max_steps=100"):
        Mixture(SOURCES, stages, global_batch_size=4, max_steps=100)
    reached = Mixture(SOURCES, stages, global_batch_size=4, max_steps=101)  # trains step 100
    assert [stage.start for stage in reached.stages] == [0, 100]
    assert len(Mixture(SOURCES, stages, global_batch_size=4).stages) == 2  # steps unknown
