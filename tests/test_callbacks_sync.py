"""No callback copies anything from the devices on a step where nothing is due.

How this is measured, and why it is honest: on the CPU backend JAX's transfer
guard (``jax.transfer_guard_device_to_host``) never fires (the arrays already
live in host memory), so it cannot be used. Instead the test counts every way
a ``jax.Array`` on the 8-device mesh reaches host memory in jax 0.10.2:

* ``ArrayImpl._value``: behind ``float()``, ``int()``, ``bool()``,
  ``np.asarray``/``np.array`` (for multi-device arrays NumPy's buffer protocol
  is refused, so NumPy falls back to ``__array__``, which reads ``_value``),
  ``jax.device_get``, ``.item()``, ``.tolist()``, ``repr``/``str``;
* ``addressable_data`` and ``addressable_shards``: the only public ways to a
  single-device piece, which NumPy could read through the buffer protocol.

Everything the trainer hands callbacks (loss, metrics, parameters, optimizer
state) lives on the mesh, so a callback cannot read a device value without
passing one of these. A probe callback that runs first in
``on_train_batch_begin`` and one that runs last in ``on_train_batch_end``
measure each step's window: the step's dispatch, the core's own bookkeeping
and every callback's hooks. The positive controls (MetricsLogger's steps,
TerminateOnNaN's check steps) show the counter does see real reads.
"""

import io

import jax.numpy as jnp
import optax
import pytest
from test_callbacks_helpers import make_batches, make_trainer

from nnx_spmd_trainer import Callback
from nnx_spmd_trainer.callbacks import (
    CSVLogger,
    EarlyStopping,
    LambdaCallback,
    LearningRateMonitor,
    MetricsLogger,
    Profiler,
    ProgressBar,
    TensorBoard,
    TerminateOnNaN,
)
from nnx_spmd_trainer.engine.metric_log import MetricLog


class HostReads:
    """Counts device-to-host reads of jax.Arrays while installed (see the module docstring)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        array_type = type(jnp.zeros(()))
        value = array_type.__dict__["_value"]
        shards = array_type.__dict__["addressable_shards"]
        data = array_type.addressable_data

        def counted_value(array):
            self.count += 1
            return value.__get__(array)

        def counted_shards(array):
            self.count += 1
            return shards.__get__(array)

        def counted_data(array, index):
            self.count += 1
            return data(array, index)

        monkeypatch.setattr(array_type, "_value", property(counted_value))
        monkeypatch.setattr(array_type, "addressable_shards", property(counted_shards))
        monkeypatch.setattr(array_type, "addressable_data", counted_data)


class StepWindow:
    """Two callbacks bracketing each training step; ``reads[step]`` is what happened inside."""

    def __init__(self, host: HostReads) -> None:
        self.reads: dict[int, int] = {}
        window = self

        class Open(Callback):
            order = -(10**9)

            def on_train_batch_begin(self, step, logs):
                window.start = host.count

        class Close(Callback):
            order = 10**9

            def on_train_batch_end(self, step, logs):
                window.reads[step] = host.count - window.start

        self.callbacks = [Open(), Close()]


@pytest.fixture
def compute_metrics_calls(monkeypatch):
    calls: list[str] = []
    original = MetricLog.compute

    def counted(self, split="train"):
        calls.append(split)
        return original(self, split)

    monkeypatch.setattr(MetricLog, "compute", counted)
    return calls


def test_non_logging_callbacks_read_nothing_between_log_points(
    tmp_path, monkeypatch, compute_metrics_calls
):
    schedule = optax.linear_schedule(0.1, 0.0, 100)
    callbacks = [
        EarlyStopping("eval/loss", patience=5),
        TerminateOnNaN(check_every_n_steps=4),
        LearningRateMonitor(),
        CSVLogger(tmp_path / "m.csv"),
        TensorBoard(tmp_path / "tb"),
        ProgressBar(file=io.StringIO(), use_tqdm=True),
        ProgressBar(file=io.StringIO(), use_tqdm=False),
        Profiler(tmp_path / "prof", start_step=100),
        LambdaCallback(on_train_batch_end=lambda step, logs: None),
    ]
    host = HostReads(monkeypatch)
    window = StepWindow(host)
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=schedule)
    trainer = make_trainer([*callbacks, *window.callbacks], tx)

    trainer.fit(make_batches(8), eval_data=make_batches(1, seed=1), max_steps=8,
                eval_every_n_steps=4)  # fmt: skip

    assert sorted(window.reads) == list(range(1, 9))
    # Only TerminateOnNaN's check steps read, and only losses of steps already waited for
    # (<= step - max_steps_in_flight = 2): the losses of steps 1 and 2, in one device_get.
    assert {step for step, n in window.reads.items() if n} == {4, 8}
    assert window.reads[4] == 2
    # Metrics left the devices only for the two evaluations, the epoch end and the end.
    assert sorted(compute_metrics_calls) == ["eval", "eval", "train", "train"]
    assert host.count > 0  # the log points outside the step windows did read


def test_metrics_logger_reads_only_on_its_steps(monkeypatch, compute_metrics_calls):
    host = HostReads(monkeypatch)
    window = StepWindow(host)
    trainer = make_trainer([MetricsLogger(3), *window.callbacks])
    trainer.fit(make_batches(6), max_steps=6)
    assert {step for step, n in window.reads.items() if n} == {3, 6}
    assert compute_metrics_calls.count("train") == 4  # steps 3 and 6, epoch end, end
