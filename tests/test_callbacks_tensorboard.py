"""TensorBoard: event files read back with TensorBoard's own reader."""

import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from clu import metrics as clu_metrics
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_callbacks_helpers import (
    CLASSES,
    DIN,
    make_batches,
    make_trainer,
    np_sgd,
    params_np,
)

from nnx_spmd_trainer import FSDP, DataParallel, Hybrid
from nnx_spmd_trainer.callbacks import LearningRateMonitor, MetricsLogger, TensorBoard
from nnx_spmd_trainer.callbacks.tensorboard import flatten_config, sharding_table
from nnx_spmd_trainer.callbacks.throughput import Throughput, batch_size_and_tokens


def _read(logdir) -> EventAccumulator:
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    return acc


def _text(acc: EventAccumulator, tag: str) -> str:
    (event,) = acc.Tensors(f"{tag}/text_summary")
    return event.tensor_proto.string_val[0].decode()


def test_scalars_config_sharding_histograms_and_hparams(tmp_path):
    config = ml_collections.ConfigDict({"lr": 0.1, "model": {"width": 3}, "name": "linear"})
    schedule = optax.constant_schedule(0.1)
    tensorboard = TensorBoard(tmp_path, histogram_every_n_steps=3, examples_per_step=16)
    trainer = make_trainer(
        [MetricsLogger(2), LearningRateMonitor(schedule=schedule), tensorboard],
        optax.sgd(schedule),
        config=config,
    )
    initial = params_np(trainer)
    batches = make_batches(6)
    history = trainer.fit(
        batches, eval_data=make_batches(2, seed=1), max_steps=6, eval_every_n_steps=3
    )

    acc = _read(tmp_path)
    scalars = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/accuracy", "eval/loss", "eval/accuracy", "lr"} <= scalars
    assert {"perf/step_time_s", "perf/steps_per_s", "perf/examples_per_s"} <= scalars
    assert "perf/tokens_per_s" not in scalars  # float features: no sequence dimension
    for tag in ["train/loss", "train/accuracy", "eval/loss", "eval/accuracy", "lr"]:
        events = acc.Scalars(tag)
        assert [e.step for e in events] == history.steps[tag], tag
        np.testing.assert_allclose([e.value for e in events], history.history[tag], rtol=1e-6)
    assert [e.step for e in acc.Scalars("train/loss")] == [2, 4, 6]
    np.testing.assert_allclose([e.value for e in acc.Scalars("lr")], 0.1, rtol=1e-6)

    steps_per_s = acc.Scalars("perf/steps_per_s")
    examples_per_s = acc.Scalars("perf/examples_per_s")
    assert [e.step for e in steps_per_s] == [2, 4, 6]
    for rate, examples in zip(steps_per_s, examples_per_s, strict=True):
        assert rate.value > 0
        assert examples.value == pytest.approx(16 * rate.value, rel=1e-5)
    for step_time, rate in zip(acc.Scalars("perf/step_time_s"), steps_per_s, strict=True):
        assert step_time.value == pytest.approx(1 / rate.value, rel=1e-5)

    config_text = _text(acc, "config")
    assert "| model.width | 3 |" in config_text and "| name | 'linear' |" in config_text
    sharding_text = _text(acc, "sharding")
    assert "| model/l/kernel | (4, 3) | float32 | P() | 48 |" in sharding_text
    assert "| model/l/bias | (3,) | float32 | P() | 12 |" in sharding_text

    # Histograms of the weights after steps 3 and 6, against NumPy SGD from the same start.
    reference = list(np_sgd(*initial, batches, lr=0.1))
    histograms = acc.Histograms("params/l/kernel")
    assert [h.step for h in histograms] == [3, 6]
    for event, (kernel, _) in zip(histograms, [reference[2], reference[5]], strict=True):
        h = event.histogram_value
        assert h.num == 12
        assert h.min == pytest.approx(kernel.min(), rel=1e-5)
        assert h.max == pytest.approx(kernel.max(), rel=1e-5)
        assert h.sum_squares == pytest.approx((kernel**2).sum(), rel=1e-5)
    assert histograms[0].histogram_value.max != pytest.approx(histograms[1].histogram_value.max)

    # hparams live in the run itself (no second run repeating the scalars), their
    # metrics being the run's own scalars.
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]
    assert "_hparams_/session_start_info" in acc.summary_metadata
    assert "_hparams_/experiment" in acc.summary_metadata


def test_sharding_table_reports_the_fsdp_shard_per_device():
    trainer = make_trainer(strategy=Hybrid(DataParallel(2), FSDP(4, min_size=1)))
    rows = {r["path"]: r for r in sharding_table(nnx.state(trainer.model, nnx.Param))}
    assert set(rows) == {"l/kernel", "l/bias"}
    kernel = rows["l/kernel"]
    # The (4, 3) kernel: dimension 0 is the one FSDP(4) divides, a quarter per device.
    assert kernel["shape"] == (4, 3) and kernel["spec"] == "P('fsdp',)"
    assert kernel["bytes_per_device"] == 1 * 3 * 4
    assert rows["l/bias"]["bytes_per_device"] == 3 * 4  # 3 does not divide by 4: whole


def test_sharding_table_of_a_sharded_array():
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    array = jax.device_put(np.zeros((16, 64), np.float32), NamedSharding(mesh, P(None, "fsdp")))
    (row,) = sharding_table({"w": array})
    assert row["path"] == "w" and row["spec"] == "P(None, 'fsdp')"
    assert row["bytes_per_device"] == 16 * 64 * 4 // 8


def test_flatten_config_handles_config_dict_dict_and_none():
    nested = ml_collections.ConfigDict({"a": 1, "b": {"c": [1, 2], "d": None}})
    assert flatten_config(nested) == {"a": 1, "b.c": [1, 2], "b.d": None}
    assert flatten_config({"x": {"y": 2.0}}) == {"x.y": 2.0}
    assert flatten_config(None) == {}


def test_batch_size_and_tokens_from_shapes():
    assert batch_size_and_tokens({"x": np.zeros((8, 4), np.float32), "y": np.zeros(8, int)}) == (
        8,
        None,
    )
    tokens = {"tokens": np.zeros((8, 128), np.int32), "mask": np.ones((8, 128), bool)}
    assert batch_size_and_tokens(tokens) == (8, 8 * 128)
    images = {"image": np.zeros((4, 28, 28, 1), np.float32), "label": np.zeros(4, np.int32)}
    assert batch_size_and_tokens(images) == (4, None)


def test_throughput_excludes_paused_time(monkeypatch):
    clock = iter([0.0, 10.0, 16.0, 20.0, 30.0])
    monkeypatch.setattr("time.perf_counter", lambda: next(clock))
    timer = Throughput()
    timer.start(step=0)  # t=0
    timer.pause()  # t=10: evaluation starts
    timer.resume()  # t=16: 6 s of evaluation are not training time
    assert timer.seconds_per_step(step=7) == pytest.approx((20.0 - 6.0) / 7)  # t=20
    assert timer.seconds_per_step(step=12) == pytest.approx(10.0 / 5)  # t=30


def test_tokens_per_second_from_the_batch_shapes(tmp_path):
    batches = make_batches(4)
    for batch in batches:  # a [batch, seq] integer leaf: 16 x 5 tokens per step
        batch["tokens"] = np.zeros((16, 5), np.int32)
    trainer = make_trainer([MetricsLogger(2), TensorBoard(tmp_path, write_hparams=False)])
    trainer.fit(batches, max_steps=4)
    acc = _read(tmp_path)
    steps_per_s = [e.value for e in acc.Scalars("perf/steps_per_s")]
    np.testing.assert_allclose([e.value for e in acc.Scalars("perf/examples_per_s")],
                               np.multiply(steps_per_s, 16), rtol=1e-5)  # fmt: skip
    # Tokens per second are the run's own (its logs carry them), written once per point.
    assert [e.step for e in acc.Scalars("perf/tokens_per_s")] == [2, 4]
    np.testing.assert_allclose([e.value for e in acc.Scalars("perf/tokens_per_s")],
                               trainer.history.history["perf/tokens_per_s"], rtol=1e-6)  # fmt: skip
    assert not (tmp_path / "hparams").exists()


@flax.struct.dataclass
class LabelCounts(clu_metrics.Metric):
    """A vector metric: how many examples of each class (one scalar per index in the logs)."""

    counts: jax.Array

    @classmethod
    def empty(cls):
        return cls(jnp.zeros(CLASSES))

    @classmethod
    def from_model_output(cls, labels, **_):
        return cls(jnp.bincount(labels, length=CLASSES).astype(jnp.float32))

    def merge(self, other):
        return type(self)(self.counts + other.counts)

    def compute(self):
        return self.counts


@flax.struct.dataclass
class Pairs(LabelCounts):
    """A 3 x 3 metric: too big to log as scalars, so named in a warning once."""

    @classmethod
    def empty(cls):
        return cls(jnp.zeros((CLASSES, CLASSES)))

    @classmethod
    def from_model_output(cls, labels, **_):
        return cls(jnp.zeros((CLASSES, CLASSES)).at[labels, labels].add(1))


def test_norms_compile_time_epoch_parameters_and_vector_metrics(tmp_path):
    metrics = clu_metrics.Collection.create(
        loss=clu_metrics.Average.from_output("loss"), labels=LabelCounts, pairs=Pairs
    )
    trainer = make_trainer([MetricsLogger(2), TensorBoard(tmp_path)], metrics=metrics)
    initial = params_np(trainer)
    batches = make_batches(4)
    with pytest.warns(UserWarning, match=r"Metric train/pairs has shape \(3, 3\)") as caught:
        trainer.fit(batches, max_steps=4)
    assert sum("train/pairs" in str(w.message) for w in caught) == 1  # once, not per log point

    acc = _read(tmp_path)
    reference = [initial, *np_sgd(*initial, batches, lr=0.1)]

    def norm(*arrays):
        return float(np.sqrt(sum((a**2).sum() for a in arrays)))

    for step in (2, 4):  # the norms of the log step itself, against NumPy SGD
        (params, before) = reference[step], reference[step - 1]
        update = norm(*(a - b for a, b in zip(params, before, strict=True)))
        want = {"param_norm": norm(*params), "update_norm": update, "grad_norm": update / 0.1}
        for name, value in want.items():
            (event,) = [e for e in acc.Scalars(f"train/{name}") if e.step == step]
            assert event.value == pytest.approx(value, rel=1e-4), (name, step)

    for step, pair in ((2, batches[:2]), (4, batches[2:])):
        counts = np.bincount(np.concatenate([b["y"] for b in pair]), minlength=CLASSES)
        for label in range(CLASSES):
            (event,) = [e for e in acc.Scalars(f"train/labels/{label}") if e.step == step]
            assert event.value == counts[label]

    (compiled,) = acc.Scalars("perf/compile_time_s")  # one compile, reported once
    assert compiled.step == 2 and compiled.value > 0
    assert [(e.step, e.value) for e in acc.Scalars("epoch")] == [(2, 0.0), (4, 0.0)]
    (parameters,) = acc.Scalars("model/parameters")
    assert parameters.value == DIN * CLASSES + CLASSES
    reports_memory = jax.devices()[0].memory_stats() is not None
    assert ("perf/device_memory_gb" in acc.Tags()["scalars"]) == reports_memory


class _Killed(Exception):
    """A run that dies mid-way (as kill -9 would), after logging steps past its checkpoint."""


@pytest.mark.parametrize("same_second", [False, True], ids=["apart", "same-second"])
def test_a_resumed_run_hides_what_the_killed_attempt_logged_past_its_checkpoint(
    tmp_path, monkeypatch, same_second
):
    import types

    from tensorboard.backend.event_processing import plugin_event_accumulator
    from tensorboardX import event_file_writer

    if same_second:  # tensorboardX names a file by its second: both attempts share one
        monkeypatch.setattr(event_file_writer, "time", types.SimpleNamespace(time=lambda: 1.7e9))

    from nnx_spmd_trainer.callbacks import LambdaCallback, OrbaxCheckpoint

    def die_after_step_6(step, logs):
        if step == 6:
            raise _Killed

    def attempt(*extra, restore=None):
        checkpoint = OrbaxCheckpoint(tmp_path / "ck", save_every_n_steps=4, restore=restore)
        return make_trainer([MetricsLogger(1), checkpoint, *extra, TensorBoard(tmp_path / "tb")])

    with pytest.raises(_Killed):  # logged steps 1-5 (6 dies before its log point); saved 4
        attempt(LambdaCallback(on_train_batch_end=die_after_step_6)).fit(
            make_batches(8), max_steps=8
        )
    with pytest.warns(UserWarning, match="no restorable position"):
        attempt(restore="latest").fit(make_batches(8), max_steps=8)  # replays 5-8

    # TensorBoard's own reader (the one its server uses) and the classic one: each step once
    served = plugin_event_accumulator.EventAccumulator(
        str(tmp_path / "tb"), size_guidance={"tensors": 0}
    )
    served.Reload()
    assert [e.step for e in served.Tensors("train/loss")] == list(range(1, 9))
    assert [e.step for e in _read(tmp_path / "tb").Scalars("train/loss")] == list(range(1, 9))
