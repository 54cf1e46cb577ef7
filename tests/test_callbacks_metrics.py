"""MetricsLogger: on-device CLU metrics reach logs every n steps, equal to a NumPy computation."""

import numpy as np
import optax
import pytest
from test_callbacks_helpers import make_batches, make_trainer, np_metrics, params_np

from nnx_spmd_trainer import FSDP, DataParallel, Hybrid, TensorParallel
from nnx_spmd_trainer.callbacks import LambdaCallback, MetricsLogger
from nnx_spmd_trainer.engine.metric_log import GOODPUT


@pytest.mark.parametrize(
    ("strategy", "rows_per_device"),
    [
        (DataParallel(), 2),  # 16 rows over 8 devices
        (Hybrid(DataParallel(2), FSDP(4, min_size=1)), 2),  # parameters sharded too
        (Hybrid(FSDP(4, min_size=1), TensorParallel(2)), 4),  # batch replicated over "model"
    ],
    ids=["dp8", "dp2xfsdp4", "fsdp4xtp2"],
)
def test_train_and_eval_metrics_equal_numpy_on_a_batch_sharded_over_8_devices(
    strategy, rows_per_device
):
    seen: dict[int, dict[str, float]] = {}
    record = LambdaCallback(on_train_batch_end=lambda step, logs: seen.update({step: dict(logs)}))
    # lr 0: fixed predictions, so every window's metrics follow from the final weights
    trainer = make_trainer([MetricsLogger(2), record], optax.sgd(0.0), strategy=strategy)
    train, evals = make_batches(6), make_batches(2, seed=1)
    placed = trainer.placement.place(train[0])
    assert placed["x"].sharding.num_devices == 8
    assert len({shard.data.shape for shard in placed["x"].addressable_shards}) == 1
    assert placed["x"].addressable_shards[0].data.shape == (rows_per_device, 4)

    history = trainer.fit(train, eval_data=evals, max_steps=6, eval_every_n_steps=3)

    kernel, bias = params_np(trainer)
    windows = [train[0:2], train[2:4], train[4:6]]  # the steps each flush covers
    expected = [np_metrics(kernel, bias, w) for w in windows]
    assert history.steps["train/loss"] == [2, 4, 6]
    np.testing.assert_allclose(
        history.history["train/loss"], [e["loss"] for e in expected], rtol=1e-5
    )
    np.testing.assert_allclose(
        history.history["train/accuracy"], [e["accuracy"] for e in expected], rtol=1e-6
    )
    expected_eval = np_metrics(kernel, bias, evals)
    assert history.steps["eval/loss"] == [3, 6]
    np.testing.assert_allclose(history.history["eval/loss"], [expected_eval["loss"]] * 2, rtol=1e-5)
    np.testing.assert_allclose(
        history.history["eval/accuracy"], [expected_eval["accuracy"]] * 2, rtol=1e-6
    )
    # Nothing reaches logs on the steps where no flush is due.
    assert [step for step, logs in seen.items() if logs] == [2, 4, 6]
    # The metrics, and what every log point reports with them (the compile, once).
    report = {"train/grad_norm", "train/update_norm", "train/param_norm", "epoch"}
    report.update({"perf/data_wait_fraction", "perf/flops_per_s_per_device"})  # no MFU: a CPU
    report.update({f"goodput/{part}_s" for part in GOODPUT} | {"goodput/wall_s"})
    assert set(seen[2]) - {"perf/device_memory_gb"} == {
        "train/loss",
        "train/accuracy",
        "perf/compile_time_s",
        *report,
    }
    assert set(seen[4]) - {"perf/device_memory_gb"} == {"train/loss", "train/accuracy", *report}


def test_flush_covers_only_the_steps_since_the_last_one_and_the_end_flushes_the_rest():
    trainer = make_trainer([MetricsLogger(4)], optax.sgd(0.0))
    train = make_batches(6)
    history = trainer.fit(train, max_steps=6)
    kernel, bias = params_np(trainer)
    # Step 4 by MetricsLogger, then the epoch end flushes steps 5 and 6.
    assert history.steps["train/loss"] == [4, 6]
    expected = [np_metrics(kernel, bias, train[:4]), np_metrics(kernel, bias, train[4:])]
    np.testing.assert_allclose(
        history.history["train/loss"], [e["loss"] for e in expected], rtol=1e-5
    )


def test_log_every_n_steps_must_be_positive():
    with pytest.raises(ValueError, match="log_every_n_steps"):
        MetricsLogger(0)
