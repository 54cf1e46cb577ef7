"""CSVLogger, ProgressBar, LearningRateMonitor and Profiler, with real files and output."""

import csv
import io

import numpy as np
import optax
import pytest
from test_callbacks_helpers import make_batches, make_trainer

from nnx_spmd_trainer.callbacks import (
    CSVLogger,
    LearningRateMonitor,
    MetricsLogger,
    Profiler,
    ProgressBar,
)
from nnx_spmd_trainer.engine.metric_log import is_perf_key


def _fit(trainer, steps=6, eval_every=3):
    return trainer.fit(
        make_batches(steps),
        eval_data=make_batches(2, seed=1),
        max_steps=steps,
        eval_every_n_steps=eval_every,
    )


# -- LearningRateMonitor ------------------------------------------------------------------------
def np_linear_schedule(count: int) -> float:
    """optax.linear_schedule(0.1, 0.0, 10), written out."""
    return 0.1 * (1.0 - min(count, 10) / 10)


def test_lr_from_inject_hyperparams_is_the_rate_of_the_last_update():
    schedule = optax.linear_schedule(0.1, 0.0, 10)
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=schedule)
    trainer = make_trainer([MetricsLogger(2), LearningRateMonitor()], tx)
    history = trainer.fit(make_batches(6), max_steps=6)
    assert history.steps["lr"] == [2, 4, 6]
    # Step s is optax's update number s - 1 (the count starts at 0).
    expected = [np_linear_schedule(s - 1) for s in (2, 4, 6)]
    np.testing.assert_allclose(history.history["lr"], expected, rtol=1e-6)


def test_lr_from_a_schedule_every_n_steps_without_metrics_logger():
    schedule = optax.linear_schedule(0.1, 0.0, 10)
    trainer = make_trainer(
        [LearningRateMonitor(log_every_n_steps=3, schedule=schedule)], optax.sgd(schedule)
    )
    history = trainer.fit(make_batches(6), max_steps=6)
    assert history.steps["lr"] == [3, 6]
    np.testing.assert_allclose(
        history.history["lr"], [np_linear_schedule(2), np_linear_schedule(5)], rtol=1e-6
    )


def test_lr_is_found_deep_inside_a_chain_and_missing_lr_is_a_clear_error():
    tx = optax.chain(
        optax.clip_by_global_norm(1.0), optax.inject_hyperparams(optax.adam)(learning_rate=3e-3)
    )
    trainer = make_trainer(tx=tx)
    assert float(
        np.asarray(optax.tree.get(trainer.optimizer.opt_state, "learning_rate")[...])
    ) == pytest.approx(3e-3)
    monitor = LearningRateMonitor()
    monitor.set_trainer(make_trainer(tx=optax.sgd(0.1)))
    with pytest.raises(ValueError, match="inject_hyperparams"):
        monitor.learning_rate()


# -- CSVLogger ------------------------------------------------------------------------------------
def test_csv_rows_match_history_and_new_columns_widen_the_header(tmp_path):
    path = tmp_path / "logs" / "metrics.csv"
    trainer = make_trainer([MetricsLogger(2), CSVLogger(path)])
    history = _fit(trainer)
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        header, rows = reader.fieldnames, list(reader)
    # eval/* first appear at step 3, after a train row was written: the header was widened.
    metrics = [key for key in header if not is_perf_key(key)]
    assert metrics == ["step", "train/loss", "train/accuracy", "eval/loss", "eval/accuracy"]
    assert {"train/grad_norm", "epoch"} <= set(header)  # the step report has columns too
    assert [(int(r["step"]), bool(r["train/loss"]), bool(r["eval/loss"])) for r in rows] == [
        (2, True, False),
        (3, False, True),
        (4, True, False),
        (6, True, True),  # the final evaluation joins its step's row: one row per step
    ]
    for key in header[1:]:
        values = [float(r[key]) for r in rows if r[key]]
        steps = [int(r["step"]) for r in rows if r[key]]
        assert steps == history.steps[key]
        np.testing.assert_allclose(values, history.history[key], rtol=1e-6)
    assert not list(tmp_path.glob("logs/*.tmp"))


def test_csv_values_of_one_step_share_its_row_whether_or_not_they_widen_the_header(tmp_path):
    logger = CSVLogger(tmp_path / "m.csv")
    logger.write(1, {"train/loss": 2.0})
    logger.write(1, {"eval/loss": 3.0})  # a new column: the header is rewritten
    logger.write(1, {"lr": 0.5})  # another
    logger.write(2, {"train/loss": 1.0})
    logger.write(2, {"eval/loss": 2.5})  # known columns: the last row cut and written again
    assert (tmp_path / "m.csv").read_text().splitlines() == [
        "step,train/loss,eval/loss,lr",
        "1,2.0,3.0,0.5",
        "2,1.0,2.5,",
    ]


def test_csv_append_keeps_earlier_rows_and_a_fresh_logger_starts_over(tmp_path):
    path = tmp_path / "metrics.csv"
    trainer = make_trainer([MetricsLogger(2), CSVLogger(path)])
    trainer.fit(make_batches(4), max_steps=4)
    resumed = make_trainer([MetricsLogger(2), CSVLogger(path, append=True)])
    resumed.step = 4  # as if restored from a checkpoint at step 4
    resumed.fit(make_batches(4), max_steps=6)
    with path.open(newline="") as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == [2, 4, 6]
    fresh = make_trainer([MetricsLogger(2), CSVLogger(path)])
    fresh.fit(make_batches(2), max_steps=2)
    with path.open(newline="") as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == [2]


# -- ProgressBar -------------------------------------------------------------------------------
def test_progress_is_quiet_off_a_tty_unless_plain_and_draws_a_bar_on_one(capsys):
    _fit(make_trainer([MetricsLogger(2), ProgressBar()]))
    assert capsys.readouterr().out == ""  # captured stdout is not a TTY: quiet
    terminal = io.StringIO()
    bar = ProgressBar(total=6, file=terminal, use_tqdm=True)
    history = _fit(make_trainer([MetricsLogger(2), ProgressBar(plain=True), bar]))
    lines = capsys.readouterr().out.splitlines()  # plain lines when asked
    assert [line.split(":")[0] for line in lines] == [
        "step 2",
        "step 3",
        "step 4",
        "step 6",
        "step 6",
    ]
    loss = history.history["train/loss"][0]
    assert lines[0] == (
        f"step 2: train/accuracy={history.history['train/accuracy'][0]:.4g} train/loss={loss:.4g}"
    )
    assert "eval/loss=" in lines[1] and "train/loss" not in lines[1]
    drawn = terminal.getvalue()
    assert "6/6" in drawn and "eval/loss=" in drawn


# -- Profiler ------------------------------------------------------------------------------------
def test_profiler_writes_a_trace_tensorboard_can_open(tmp_path):
    profiler = Profiler(tmp_path, start_step=1, num_steps=2)
    trainer = make_trainer([profiler])
    trainer.fit(make_batches(4), max_steps=4)
    traces = list(tmp_path.glob("plugins/profile/*/*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0
    assert profiler.done and profiler.state_dict() == {"done": True}


def test_profiler_stops_at_the_end_of_fit_inside_its_window(tmp_path):
    profiler = Profiler(tmp_path, start_step=1, num_steps=100)
    make_trainer([profiler]).fit(make_batches(3), max_steps=3)
    assert profiler.done
    assert list(tmp_path.glob("plugins/profile/*/*.xplane.pb"))
