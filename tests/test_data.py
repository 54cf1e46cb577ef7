"""The in-flight bound and batch placement, without a Trainer."""

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from nnx_spmd_trainer import DataParallel, Hybrid, ShardingError, TensorParallel
from nnx_spmd_trainer.data import place_batch
from nnx_spmd_trainer.data.placement import InFlight


class Marker:
    """Stands in for a step's output: records when the host waited on it."""

    def __init__(self, step: int, waited: list[int]) -> None:
        self.step, self.waited = step, waited

    def block_until_ready(self) -> "Marker":
        self.waited.append(self.step)
        return self


def test_in_flight_blocks_on_the_oldest_beyond_the_limit():
    waited: list[int] = []
    bound = InFlight(2)
    for step in range(1, 6):
        bound.add(Marker(step, waited))
        assert waited == list(range(1, max(step - 2, 0) + 1))  # step n waits on step n-2
    bound.drain()
    assert waited == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match=">= 1"):
        InFlight(0)


def test_place_batch_splits_rows_over_the_batch_axes_only():
    strategy = Hybrid(DataParallel(4), TensorParallel(2))
    mesh = strategy.make_mesh()
    batch = {"x": np.arange(16 * 3, dtype=np.float32).reshape(16, 3), "y": np.arange(16)}
    placed = place_batch(batch, strategy.batch_sharding(batch, mesh))
    assert placed["x"].sharding.spec == P(("data",))
    assert placed["x"].addressable_shards[0].data.shape == (4, 3)  # replicated over "model"
    np.testing.assert_array_equal(np.asarray(placed["x"]), batch["x"])
    with pytest.raises(ShardingError, match=r"batch leaf \['x'\].*4 parts x 3 microbatches.*by 12"):
        place_batch(batch, strategy.batch_sharding(batch, mesh), divisor=3)
