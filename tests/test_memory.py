"""Per-device memory from XLA's own analysis: FSDP holds 1/8 of what DataParallel holds."""

import jax
import numpy as np
import optax
import pytest
from toy_models import Net, classification_loss, make_batches

from nnx_spmd_trainer import FSDP, DataParallel, Trainer

WIDE = dict(din=256, hidden=512, dout=256)  # ~0.5M parameters: state dwarfs the batch


def build(strategy):
    return Trainer(
        lambda r: Net(r, **WIDE), optax.adam(1e-3), strategy=strategy, loss_fn=classification_loss
    )


def state_argument_bytes(trainer, batch):
    """Argument bytes per device of the compiled step, less the batch and the metrics."""
    analysis = trainer.plan.lower(batch, train_step=trainer.train_step).compile().memory_analysis()
    placed = trainer.placement.place(batch)
    batch_bytes = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(placed))
    metric_bytes = sum(x.nbytes for x in jax.tree.leaves(trainer.metric_log.train))
    return analysis.argument_size_in_bytes - batch_bytes - metric_bytes


@pytest.fixture(scope="module")
def trainers():
    return build(DataParallel()), build(FSDP())


def test_fsdp_step_arguments_are_an_eighth_of_data_parallel(trainers):
    dp, fsdp = trainers
    batch = make_batches(1, batch_size=8, din=WIDE["din"], classes=WIDE["dout"])[0]
    dp_bytes, fsdp_bytes = state_argument_bytes(dp, batch), state_argument_bytes(fsdp, batch)
    total = sum(x.nbytes for x in jax.tree.leaves(dp.state))
    assert dp_bytes == pytest.approx(total, rel=0.01)  # DP: every device holds everything
    assert fsdp_bytes == pytest.approx(dp_bytes / 8, rel=0.10)
    assert "all-gather" in fsdp.plan.lower(batch).compile().as_text()


def test_sharded_init_outputs_are_an_eighth_per_device(trainers):
    dp, fsdp = trainers
    out = [
        t.plan._init.init_fn.lower().compile().memory_analysis().output_size_in_bytes
        for t in (dp, fsdp)
    ]
    assert out[1] == pytest.approx(out[0] / 8, rel=0.10)
    # and what init produced really is laid out that way on every device
    per_device = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(fsdp.state))
    assert per_device == pytest.approx(out[1], rel=0.01)
    assert np.isfinite(per_device)
