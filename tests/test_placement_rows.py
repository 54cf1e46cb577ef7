"""Processes that feed the same rows must feed equal batches: the fingerprint that compares
them, the verdict every process reaches, and the exchange (a stand-in coordination service,
no processes; tests/test_multiprocess.py runs two real ones)."""

from __future__ import annotations

import json
import threading

import jax
import numpy as np
import pytest

from nnx_spmd_trainer.data import same_rows
from nnx_spmd_trainer.data.same_rows import (
    batch_fingerprint,
    check_same_rows,
    leaf_fingerprint,
    same_rows_error,
)
from nnx_spmd_trainer.data_shard import DataShard
from nnx_spmd_trainer.distributed.agree import Agreement
from nnx_spmd_trainer.sharding import ShardingError


def _batch(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(8, 5)).astype(np.float32),
        "y": rng.integers(0, 8, 8).astype(np.int32),
    }


def test_fingerprint_is_equal_for_equal_batches_and_differs_for_any_changed_row():
    batch = _batch()
    same = batch_fingerprint({k: v.copy() for k, v in batch.items()})
    assert batch_fingerprint(batch) == same
    assert batch_fingerprint(jax.tree.map(jax.numpy.asarray, batch)) == same  # device copy
    for key in batch:
        for row in range(8):
            changed = {k: v.copy() for k, v in batch.items()}
            changed[key][row] += 1
            other = batch_fingerprint(changed)
            # Only the changed leaf's fingerprint moves.
            assert [a != b for a, b in zip(other, same, strict=True)] == [k == key for k in batch]
    # Rows in another order, another half of the global batch, a shorter batch.
    assert batch_fingerprint({**batch, "x": batch["x"][::-1]}) != same
    assert batch_fingerprint(_batch(1)) != same
    assert batch_fingerprint({k: v[:4] for k, v in batch.items()}) != same


def test_swapping_rows_with_equal_byte_sums_changes_the_fingerprint():
    # One-hot rows: every row has the same bytes in another place (a linear weight's
    # blind spot is a swap of rows whose byte sums are equal).
    rows = np.eye(8, dtype=np.float32)
    assert leaf_fingerprint(rows) != leaf_fingerprint(rows[[1, 0, *range(2, 8)]])
    assert leaf_fingerprint(rows) != leaf_fingerprint(rows[::-1])


def test_any_one_byte_changed_anywhere_changes_the_fingerprint():
    data = np.arange(256, dtype=np.uint8).reshape(16, 16)
    base = leaf_fingerprint(data)
    for position in range(data.size):
        for value in (0, 1, 127, 128, 255):
            changed = data.copy().reshape(-1)
            if changed[position] == value:
                continue
            changed[position] = value
            assert leaf_fingerprint(changed.reshape(16, 16)) != base, (position, value)


def test_same_bytes_in_another_shape_or_dtype_differ():
    x = np.arange(8, dtype=np.int32)
    assert leaf_fingerprint(x) != leaf_fingerprint(x.reshape(2, 4))
    assert leaf_fingerprint(x) != leaf_fingerprint(x.view(np.float32))


def test_the_verdict_names_the_process_its_rows_and_the_fix():
    whole, half = batch_fingerprint(_batch()), batch_fingerprint(_batch(1))
    names = ["['x']", "['y']"]
    assert same_rows_error([(0, 1), (0, 1)], [whole, whole], names) is None
    message = same_rows_error([(0, 1), (0, 1)], [whole, half], names)
    assert message is not None
    assert "process 1 fed a batch unlike process 0's (leaves ['x'], ['y'])" in message
    assert "DataShard(index=0, count=1)" in message
    assert "every process feeds the whole global batch" in message
    assert "rows[index::count]" in message
    # Processes with different indices feed different rows: nothing to compare.
    assert same_rows_error([(0, 2), (1, 2)], [whole, half], names) is None
    # Four processes, two per index: only the pair that disagrees is named.
    message = same_rows_error([(0, 2), (0, 2), (1, 2), (1, 2)], [whole, whole, half, whole], names)
    assert message is not None and "process 3 fed a batch unlike process 2's" in message
    assert "process 1" not in message and "count=1:" not in message
    # A process feeding half the rows: its shapes are named too.
    message = same_rows_error(
        [(0, 1), (0, 1)], [whole, half], names, shapes=[[(8, 5), (8,)], [(4, 5), (4,)]]
    )
    assert message is not None and "shapes [(4, 5), (4,)] against [(8, 5), (8,)]" in message


class _Coordinator:
    """A stand-in for JAX's key-value store; process 1's values set by the test."""

    def __init__(self) -> None:
        self.store: dict[str, str] = {}
        self.agreement = Agreement(self, 0, 2)  # this process: 0 of 2

    def key_value_set(self, key: str, value: str) -> None:
        self.store[key] = value

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
        if key not in self.store:
            raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
        return self.store[key]


@pytest.fixture
def as_process_0_of_2(monkeypatch) -> _Coordinator:
    coordinator = _Coordinator()
    monkeypatch.setattr(Agreement, "current", lambda: coordinator.agreement)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    return coordinator


def _process_1_feeds(coordinator: _Coordinator, batch: dict, shard: DataShard) -> None:
    """What process 1 publishes at its first check of this kind of batch."""
    value = {
        "shard": list(shard),
        "shapes": [list(np.shape(x)) for x in jax.tree.leaves(batch)],
        "fingerprints": batch_fingerprint(batch),
    }
    key = coordinator.agreement.key(same_rows.topic(batch), 0, 1)
    coordinator.store[key] = json.dumps(value)


def test_the_check_passes_equal_batches_and_raises_on_different_ones(as_process_0_of_2):
    batch, shard = _batch(), DataShard(0, 1)
    _process_1_feeds(as_process_0_of_2, batch, shard)
    check_same_rows(batch, shard)  # agree

    as_process_0_of_2.agreement = Agreement(as_process_0_of_2, 0, 2)  # a fresh runtime
    as_process_0_of_2.store.clear()
    _process_1_feeds(as_process_0_of_2, _batch(1), shard)
    with pytest.raises(ShardingError, match=r"process 1 fed a batch unlike process 0's"):
        check_same_rows(batch, shard)


def test_a_process_feeding_another_number_of_rows_is_named_not_waited_for(as_process_0_of_2):
    batch = _batch()
    _process_1_feeds(as_process_0_of_2, {k: v[:4] for k, v in batch.items()}, DataShard(0, 1))
    with pytest.raises(ShardingError, match=r"shapes \[\(4, 5\), \(4,\)\] against \[\(8, 5\)"):
        check_same_rows(batch, DataShard(0, 1))


def test_each_structure_and_thread_counts_its_own_checks(as_process_0_of_2):
    """A check's key is the batch's structure, the thread and how many such checks came
    before: never the shapes (compared instead), never another thread's checks."""
    batch = _batch()
    agreement = as_process_0_of_2.agreement
    first = agreement.key(same_rows.topic(batch), 0, 0)
    _process_1_feeds(as_process_0_of_2, batch, DataShard(0, 1))
    check_same_rows(batch, DataShard(0, 1))
    assert first in as_process_0_of_2.store
    assert agreement.rounds(same_rows.topic(batch)) == 1
    assert agreement.rounds(same_rows.topic({"x": batch["x"]})) == 0
    assert same_rows.structure(batch) == "{['x'], ['y']} placed by the main thread"
    seen: list[str] = []
    thread = threading.Thread(target=lambda: seen.append(same_rows.structure(batch)))
    thread.start()
    thread.join()
    assert seen == ["{['x'], ['y']} placed by the other thread"]


def test_a_second_placement_takes_the_next_round_not_the_first_ones_values(as_process_0_of_2):
    """The rounds belong to the joined runtime, not to a Placement: a second check of the
    same kind of batch in this process (another trainer, another of auto's candidates)
    meets process 1's second check, not the values of its first."""
    batch = _batch()
    _process_1_feeds(as_process_0_of_2, batch, DataShard(0, 1))
    check_same_rows(batch, DataShard(0, 1))
    with pytest.raises(RuntimeError, match=r"process 1 did not place a batch like"):
        check_same_rows(batch, DataShard(0, 1))  # process 1's round 1 never comes
    assert as_process_0_of_2.agreement.key(same_rows.topic(batch), 1, 0) in as_process_0_of_2.store


def test_a_process_that_never_places_this_kind_is_named(as_process_0_of_2):
    batch = _batch()
    with pytest.raises(RuntimeError, match=r"process 1 did not place a batch like \{\['x'\]"):
        check_same_rows(batch, DataShard(0, 1))


def test_one_process_checks_nothing(monkeypatch):
    monkeypatch.setattr(Agreement, "current", lambda: pytest.fail("asked"))
    check_same_rows(_batch(), DataShard(0, 1))
