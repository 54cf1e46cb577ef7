"""Hooks are handed a ``StepRecord`` (``self.step_record``; ``trainer.last_step``), not
the trainer's insides.

The record of each step carries its global step, its loss (still on the devices),
its batch's shapes and host timings; the placed batch is handed only to a callback that
asks (``needs_batch``) and kept by nothing else; the log schedule is a trainer setting
that a layout chosen later leaves alone; the 0.1 names on ``trainer.metric_log`` still
answer, with a ``DeprecationWarning``.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import numpy as np
import pytest
from test_callbacks_helpers import BATCH, DIN, make_batches, make_trainer

from nnx_spmd_trainer import (
    Auto,
    Callback,
    DataParallel,
    LayoutNotChosen,
    StepRecord,
    deprecation,
)
from nnx_spmd_trainer.callbacks import MetricsLogger


class KeepRecords(Callback):
    """Every step's record and the logs its ``on_train_batch_end`` got."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, StepRecord, dict[str, float]]] = []

    def on_train_batch_end(self, step: int, logs: dict[str, float]) -> None:
        record = self.step_record  # handed, not fetched
        assert record is not None and record is self.trainer.last_step
        assert self.step_batch is None  # it did not ask for the batch
        self.seen.append((step, record, dict(logs)))


class KeepBatches(Callback):
    """Asks for the placed batch: every step's, as it is handed."""

    needs_batch = True

    def __init__(self) -> None:
        self.batches: list[dict[str, jax.Array]] = []

    def on_train_batch_end(self, step: int, logs: dict[str, float]) -> None:
        self.batches.append(self.step_batch)


def numpy_loss(kernel: np.ndarray, bias: np.ndarray, batch: dict[str, np.ndarray]) -> float:
    """Softmax cross-entropy of the linear classifier, in float64 NumPy."""
    logits = batch["x"].astype(np.float64) @ kernel + bias
    logits -= logits.max(axis=1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    return float(-log_probs[np.arange(len(batch["y"])), batch["y"]].mean())


def test_a_callback_gets_each_steps_record_with_its_step_and_the_logged_loss():
    keep = KeepRecords()
    trainer = make_trainer([keep], log_every_n_steps=1)
    batches = make_batches(3)
    kernel = np.asarray(trainer.model.l.kernel[...], np.float64)
    bias = np.asarray(trainer.model.l.bias[...], np.float64)
    assert trainer.last_step is None

    trainer.fit(batches, max_steps=3)

    assert [step for step, _, _ in keep.seen] == [1, 2, 3]
    for step, record, logs in keep.seen:
        assert record.step == step
        assert isinstance(record.loss, jax.Array)  # handed over on device, read on demand
        assert record.loss_value() == pytest.approx(logs["train/loss"], rel=1e-6)
    # The first step's loss is the initial weights' on the first batch.
    assert keep.seen[0][1].loss_value() == pytest.approx(
        numpy_loss(kernel, bias, batches[0]), rel=1e-5
    )
    record = keep.seen[0][1]
    assert record.batch_shapes["x"].shape == (BATCH, DIN)
    assert record.batch_shapes["y"].dtype == np.int32
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(record.batch_shapes))
    # Only the first step traced and compiled; every step spent host time dispatching.
    assert record.compile_s > 0 and keep.seen[1][1].compile_s == 0.0
    assert all(r.step_s > 0 and r.data_wait_s >= 0 for _, r, _ in keep.seen)
    assert trainer.last_step is keep.seen[-1][1]
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.step = 7  # type: ignore[misc]


def warned(old: str, use):
    """What ``use()`` returns, after checking it warned (``DeprecationWarning``) about ``old``."""
    deprecation._warned.discard(old)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = use()
    (warning,) = caught
    assert warning.category is DeprecationWarning and old in str(warning.message)
    return value, str(warning.message)


def test_the_0_1_names_on_the_metric_log_warn_and_read_their_new_homes():
    trainer = make_trainer(log_every_n_steps=4)
    trainer.fit(make_batches(2), max_steps=2)
    log, record = trainer.metric_log, trainer.last_step
    assert record is not None

    loss, message = warned("MetricLog.last_loss", lambda: log.last_loss)
    assert loss is record.loss and "trainer.last_step.loss" in message
    # No callback asked for the batch, so none was kept: the error says how to ask.
    with pytest.raises(AttributeError, match=r"needs_batch = True .* self\.step_batch"):
        warned("MetricLog.last_batch", lambda: log.last_batch)
    perf, message = warned("MetricLog.perf", lambda: log.perf)
    assert perf is trainer.run.timings and "trainer.run.timings" in message
    warned("MetricLog.request_log_every", lambda: log.request_log_every(3))
    assert trainer.log_schedule.log_every == (3, 4)
    assert warned("MetricLog.log_every", lambda: log.log_every)[0] == (3, 4)


def test_the_log_schedule_asked_before_auto_chooses_is_the_one_it_trains_with():
    keep = KeepRecords()
    trainer = make_trainer(
        [keep, MetricsLogger(log_every_n_steps=2)],
        strategy=Auto(candidates=[DataParallel()], steps=1, rounds=1, print_fn=None),
        log_every_n_steps=3,
        track_norms=False,
    )
    schedule = trainer.log_schedule
    assert schedule.log_every == (2, 3)
    with pytest.raises(LayoutNotChosen):
        trainer.metric_log  # noqa: B018 - a plan's accumulators need the plan

    trainer.fit(make_batches(6), max_steps=6)

    assert trainer.log_schedule is schedule and schedule.log_every == (2, 3)
    logged = [step for step, _, logs in keep.seen if "train/loss" in logs]
    assert logged == [2, 3, 4, 6]
    assert not any("train/grad_norm" in logs for _, _, logs in keep.seen)


def live_batch_arrays() -> list[jax.Array]:
    """The live device arrays shaped like a batch's ``x``: (BATCH, DIN) float32 (nothing in
    the model or its optimizer has that shape)."""
    return [a for a in jax.live_arrays() if a.shape == (BATCH, DIN) and a.dtype == np.float32]


def test_no_placed_batch_outlives_its_step_unless_a_callback_asks_for_it():
    batches = make_batches(3)
    before = len(live_batch_arrays())
    trainer = make_trainer([KeepRecords()], log_every_n_steps=1, prefetch=0)
    trainer.fit(batches, max_steps=3)
    assert len(live_batch_arrays()) == before  # the last step's batch was not kept

    keep = KeepBatches()
    asking = make_trainer([keep, KeepRecords()], log_every_n_steps=1, prefetch=0)
    asking.fit(batches, max_steps=3)
    # Handed each step's placed batch: the host rows, laid out as the plan lays batches out.
    assert len(keep.batches) == 3 and len({id(b["x"]) for b in keep.batches}) == 3
    assert len(live_batch_arrays()) == before + 3  # what the count sees of a kept batch
    for placed, host in zip(keep.batches, batches, strict=True):
        np.testing.assert_array_equal(np.asarray(placed["x"]), host["x"])
        assert placed["x"].sharding == asking.last_step.batch_shapes["x"].sharding
    # The deprecated name reads the batch the callback was handed last.
    latest, message = warned("MetricLog.last_batch", lambda: asking.metric_log.last_batch)
    assert latest is keep.batches[-1] and "needs_batch" in message


def test_the_callback_list_hands_logs_no_hook_produced_to_the_writers():
    """``on_logs`` is the list's own typed method (the loop once reached its private
    dispatch for ``strategy="auto"``'s first logs): only overriding callbacks get it."""
    got: list[tuple[int, dict[str, float]]] = []

    class Writer(Callback):
        def on_logs(self, step: int, logs: dict[str, float]) -> None:
            got.append((step, dict(logs)))

    trainer = make_trainer([Writer(), KeepRecords()])
    trainer.callbacks.on_logs(0, {"layout/candidates": 2.0})
    assert got == [(0, {"layout/candidates": 2.0})]
    assert trainer.history.history["layout/candidates"] == [2.0]
