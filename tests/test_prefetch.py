"""Batches placed ahead of the steps: exact data positions, errors at their step, Grain inputs."""

from __future__ import annotations

import time

import grain
import numpy as np
import optax
import pytest
from toy_models import Net, RecordLosses, classification_loss, make_batches

from nnx_spmd_trainer import BatchMismatch, ShardingError, Trainer

BATCHES = make_batches(6)


def trainer(**kwargs) -> tuple[Trainer, RecordLosses]:
    losses = RecordLosses()
    made = Trainer(Net, optax.sgd(0.1), loss_fn=classification_loss, callbacks=[losses], **kwargs)
    return made, losses


class Counting:
    """An iterator with a Grain-like position, counting what was taken from it."""

    def __init__(self, batches: list[dict]) -> None:
        self.batches, self.index, self.taken = batches, 0, 0

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self.index == len(self.batches):
            raise StopIteration
        self.index += 1
        self.taken = max(self.taken, self.index)
        return self.batches[self.index - 1]

    def get_state(self) -> dict:
        return {"next_index": self.index}

    def set_state(self, state: dict) -> None:
        self.index = state["next_index"]


def test_a_positioned_iterator_is_read_ahead_and_set_back_to_the_steps_taken():
    made, _ = trainer(prefetch=3)
    source = Counting(BATCHES)
    made.fit(source, max_steps=2)
    assert source.taken > 2  # read ahead of the steps...
    assert source.get_state() == {"next_index": 2}  # ...and set back after the last one
    made.fit(source, max_steps=4)  # so a second fit goes on from batch 2
    assert made.progress.batches_in_epoch == 2 and source.get_state() == {"next_index": 4}


def test_a_one_shot_generator_is_not_read_ahead():
    made, losses = trainer(prefetch=3)
    generator = iter(list(BATCHES))  # no get_state: what runs ahead would be lost
    made.fit(generator, max_steps=2)
    np.testing.assert_array_equal(next(generator)["x"], BATCHES[2]["x"])


def test_prefetched_training_equals_training_without_it():
    ahead, ahead_losses = trainer(prefetch=2)
    ahead.fit(BATCHES, max_steps=6)
    plain, plain_losses = trainer(prefetch=0)
    plain.fit(BATCHES, max_steps=6)
    assert ahead_losses.losses == plain_losses.losses  # bitwise: the same steps


def test_a_bad_batch_read_ahead_fails_at_its_own_step():
    made, _ = trainer(prefetch=3)
    bad = [*BATCHES[:3], {"x": BATCHES[3]["x"][:5], "y": BATCHES[3]["y"][:5]}, *BATCHES[4:]]
    with pytest.raises(BatchMismatch, match=r"^step 4: .*5 rows") as caught:
        made.fit(bad, max_steps=6)
    assert isinstance(caught.value.__cause__, ShardingError)
    assert isinstance(caught.value, ShardingError)  # what a ragged batch raised before 0.2
    assert made.step == 3  # the three good batches before it trained


class Slow:
    """A re-iterable source that takes ``seconds`` to produce each batch."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __iter__(self):
        for batch in BATCHES:
            time.sleep(self.seconds)
            yield batch


def test_the_share_of_time_waiting_for_input_is_reported():
    made, _ = trainer(prefetch=0, log_every_n_steps=3)
    made.fit(Slow(0.3), max_steps=6)
    waiting = made.history.history["perf/data_wait_fraction"]
    assert len(waiting) == 2 and all(0.0 < w <= 1.0 for w in waiting)
    # 0.3 s a batch is waited for, however slow the steps are on a loaded machine
    assert made.history.history["goodput/data_wait_s"][-1] >= 0.9 * 6 * 0.3
    fast, _ = trainer(log_every_n_steps=3)
    fast.fit(BATCHES, max_steps=6)
    assert all(0.0 <= w <= 1.0 for w in fast.history.history["perf/data_wait_fraction"])


@pytest.fixture(scope="module")
def list_losses() -> list[float]:
    """The losses of the run on the plain list: the same for every kind of Grain input."""
    reference, reference_losses = trainer()
    reference.fit(BATCHES, max_steps=6)
    return reference_losses.losses


@pytest.mark.parametrize("kind", ["MapDataset", "IterDataset", "DataLoader"])
def test_grain_map_and_iter_datasets_and_data_loaders_train_like_a_list(kind, list_losses):
    source = grain.MapDataset.source(BATCHES)
    data = {
        "MapDataset": lambda: source,
        "IterDataset": lambda: source.to_iter_dataset(),
        "DataLoader": lambda: grain.DataLoader(
            data_source=BATCHES,
            sampler=grain.samplers.IndexSampler(
                len(BATCHES), shard_options=grain.sharding.NoSharding(), num_epochs=1
            ),
            worker_count=0,
        ),
    }[kind]()
    made, losses = trainer()
    made.fit(data, max_steps=6)
    assert losses.losses == list_losses
