"""Placement asks the strategy once per kind of batch, in training and in evaluation."""

import optax
from toy_models import Net, classification_loss, make_batches

from nnx_spmd_trainer import DataParallel, Trainer


class CountingDataParallel(DataParallel):
    def __init__(self) -> None:
        super().__init__()
        object.__setattr__(self, "asked", [])

    def batch_sharding(self, batch, mesh, proposed=None):
        self.asked.append(1)
        return super().batch_sharding(batch, mesh, proposed)


def asks_to_evaluate(batches: list[dict]) -> int:
    strategy = CountingDataParallel()
    trainer = Trainer(Net, optax.sgd(0.1), strategy=strategy, loss_fn=classification_loss)
    before = len(strategy.asked)
    trainer.evaluate(batches)
    return len(strategy.asked) - before


def test_evaluation_asks_the_strategy_once_per_kind_of_batch_not_per_batch():
    one, many = asks_to_evaluate(make_batches(1)), asks_to_evaluate(make_batches(6))
    assert many == one
    # a last batch that must be padded is another kind: asked again, once
    uneven = make_batches(3) + make_batches(1, batch_size=12)
    assert asks_to_evaluate(uneven) <= one + 3
