"""MLflowLogger against MLflow's real local store, WandbLogger in W&B's offline mode.

Each run here is read back with the tracker's own client (MLflow) or W&B's own record
format (the ``.wandb`` file), and compared with TensorBoard's event files or with an
uninterrupted run's history.
"""

from __future__ import annotations

import http.server
import io
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import ml_collections
import numpy as np
import optax
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_callbacks_helpers import make_batches, make_trainer

from nnx_spmd_trainer import distributed
from nnx_spmd_trainer.app.job_callbacks import make_loggers
from nnx_spmd_trainer.app.run_config import ConfigError
from nnx_spmd_trainer.callbacks import (
    LambdaCallback,
    LearningRateMonitor,
    MetricsLogger,
    MLflowLogger,
    OrbaxCheckpoint,
    TensorBoard,
    WandbLogger,
)
from nnx_spmd_trainer.configs import _base

mlflow = pytest.importorskip("mlflow")
pytest.importorskip("sqlalchemy")  # MLflow's sqlite:/// store
wandb = pytest.importorskip("wandb")

HERE = Path(__file__).parent
#: Scalars TensorBoard times itself (not in ``logs``): every other scalar is a logs value.
TB_ONLY = {"perf/step_time_s", "perf/steps_per_s", "perf/examples_per_s", "model/parameters"}
CONFIG = {"lr": 0.1, "model": {"width": 3}, "name": "linear"}
CONFIG_FLAT = {"lr": 0.1, "model.width": 3, "name": "linear"}


def mlflow_logger(tmp_path: Path, **kwargs) -> MLflowLogger:
    return MLflowLogger(
        f"sqlite:///{tmp_path / 'mlflow.db'}",
        experiment="trackers",
        artifact_location=str(tmp_path / "artifacts"),
        **kwargs,
    )


def history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def only_run(client):
    (experiment,) = [e for e in client.search_experiments() if e.name == "trackers"]
    (run,) = client.search_runs([experiment.experiment_id])
    return run


# -- MLflow -----------------------------------------------------------------------------------
def test_mlflow_holds_the_tensorboard_scalars_the_config_and_the_plan(tmp_path):
    logger = mlflow_logger(tmp_path, run_name="a")
    trainer = make_trainer(
        [
            MetricsLogger(2),
            LearningRateMonitor(schedule=optax.constant_schedule(0.1)),
            TensorBoard(tmp_path / "tb"),
            logger,
        ],
        optax.sgd(0.1),
        config=ml_collections.ConfigDict(CONFIG),
    )
    trainer.fit(make_batches(6), eval_data=make_batches(2, seed=1), max_steps=6,
                eval_every_n_steps=3)  # fmt: skip

    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"]) - TB_ONLY
    assert {"train/loss", "train/accuracy", "eval/loss", "lr"} <= tags
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = only_run(client)
    assert run.info.run_id == logger.run_id and run.info.run_name == "a"
    assert run.info.status == "FINISHED"
    assert set(run.data.metrics) == tags
    for tag in tags:
        scalars = [(e.step, e.value) for e in events.Scalars(tag)]
        logged = history(client, logger.run_id, tag)
        assert [s for s, _ in logged] == [s for s, _ in scalars], tag
        # TensorBoard keeps float32; MLflow the float64 the logs held
        np.testing.assert_allclose([v for _, v in logged], [v for _, v in scalars], rtol=1e-6)
    assert [s for s, _ in history(client, logger.run_id, "train/loss")] == [2, 4, 6]

    assert run.data.params == {"lr": "0.1", "model.width": "3", "name": "linear"}
    plan = Path(client.download_artifacts(logger.run_id, "plan.txt", str(tmp_path / "dl")))
    text = plan.read_text()
    assert text.startswith("plan: DataParallel") and "mesh" in text, text[:300]


KILLED_RUN = """
import os, signal, sys
sys.path.insert(0, {tests!r})
import optax
from test_callbacks_helpers import make_batches, make_trainer
from nnx_spmd_trainer.callbacks import LambdaCallback, MetricsLogger, OrbaxCheckpoint
from test_trackers import mlflow_logger
from pathlib import Path

checkpoint = OrbaxCheckpoint({ckpt!r}, save_every_n_steps=3)

def kill(step):
    if step == 5:  # steps 4 and 5 logged, the checkpoint of step 3 on disk
        checkpoint.manager.wait_until_finished()
        os.kill(os.getpid(), signal.SIGKILL)

trainer = make_trainer(
    [MetricsLogger(1), checkpoint, mlflow_logger(Path({tmp!r})),
     LambdaCallback(on_step_end=kill)],
    optax.sgd(0.1),
)
trainer.fit(make_batches(8), max_steps=8)
"""


@pytest.mark.slow
def test_mlflow_a_killed_run_resumes_into_the_same_run_each_step_once(tmp_path):
    ckpt = tmp_path / "ckpt"
    script = KILLED_RUN.format(tests=str(HERE), ckpt=str(ckpt), tmp=str(tmp_path))
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = only_run(client).info.run_id
    assert only_run(client).info.status == "RUNNING"  # nobody closed it
    assert [s for s, _ in history(client, run_id, "train/loss")] == [1, 2, 3, 4, 5]

    logger, reported = mlflow_logger(tmp_path), []
    heard = LambdaCallback(on_logs=lambda step, logs: reported.append(step))
    resumed = make_trainer([MetricsLogger(1), OrbaxCheckpoint(ckpt), logger, heard],
                           optax.sgd(0.1))  # fmt: skip
    resumed.fit(make_batches(8), max_steps=8)
    assert reported[:2] == [4, 5]  # restored at 3: steps 4 and 5 were reported again
    whole = make_trainer([MetricsLogger(1)], optax.sgd(0.1))
    whole.fit(make_batches(8), max_steps=8)

    run = only_run(client)
    assert logger.run_id == run_id and run.info.status == "FINISHED"
    logged = history(client, run_id, "train/loss")
    assert [s for s, _ in logged] == [1, 2, 3, 4, 5, 6, 7, 8]  # no gap, no step twice
    np.testing.assert_allclose(
        [v for _, v in logged], whole.history.history["train/loss"], rtol=1e-6
    )


def test_mlflow_out_of_reach_warns_once_and_the_run_finishes(tmp_path):
    # MLflow's own defaults (7 retries with backoff: minutes) are left as they are.
    with socket.socket() as probe:  # a loopback port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    logger = MLflowLogger(f"http://127.0.0.1:{port}", experiment="trackers")
    trainer = make_trainer([MetricsLogger(1), logger], optax.sgd(0.1))
    start = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(make_batches(3), max_steps=3)
    mine = [w for w in caught if "MLflowLogger" in str(w.message)]
    assert len(mine) == 1, [str(w.message) for w in caught]
    assert "training goes on" in str(mine[0].message)
    assert f"no MLflow server answers at http://127.0.0.1:{port}" in str(mine[0].message)
    assert time.monotonic() - start < 60  # not MLflow's retries (2 + 4 + ... + 64 s at least)
    assert trainer.step == 3 and trainer.history.steps["train/loss"] == [1, 2, 3]
    assert logger.run_id is None


def test_the_probe_counts_any_answer_and_leaves_credentials_out():
    """A server answering 404 to ``/`` answers; a URI's ``user:password@`` is not taken for
    its host, and no message repeats the password."""
    from nnx_spmd_trainer.callbacks.mlflow_logger import _check_answers

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_error(404)

        def log_message(self, *args):
            pass

    with http.server.HTTPServer(("127.0.0.1", 0), NotFound) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            _check_answers(f"http://user:secret@127.0.0.1:{server.server_port}", 5.0)
        finally:
            server.shutdown()
        port = server.server_port
    with pytest.raises(ConnectionError, match=r"at http://127\.0\.0\.1:\d+ within") as caught:
        _check_answers(f"http://user:secret@127.0.0.1:{port}", 5.0)  # closed now
    assert "secret" not in str(caught.value)


WORKER = """
import sys
sys.path.insert(0, {tests!r})
from nnx_spmd_trainer import distributed
from nnx_spmd_trainer.app.job_callbacks import make_loggers
from nnx_spmd_trainer.app.run_config import ConfigError
assert distributed.initialize()
import jax, optax
from pathlib import Path
from mp_runs import local_rows
from test_callbacks_helpers import make_batches, make_trainer
from test_trackers import mlflow_logger
from nnx_spmd_trainer.callbacks import MetricsLogger

index, count = jax.process_index(), jax.process_count()
logger = mlflow_logger(Path({tmp!r}))
trainer = make_trainer([MetricsLogger(1), logger], optax.sgd(0.1))
trainer.fit([local_rows(b, index, count) for b in make_batches(4)], max_steps=4)
print(f"process {{index}} run_id={{logger.run_id}}", flush=True)
"""


@pytest.mark.slow
@pytest.mark.serial
def test_mlflow_two_processes_one_writer(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(tests=str(HERE), tmp=str(tmp_path)))
    log = io.StringIO()
    status = distributed.Launch([sys.executable, str(script)], 2, out=log).run()
    assert status == 0, log.getvalue()[-4000:]
    assert "process 1 run_id=None" in log.getvalue(), log.getvalue()[-2000:]

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = only_run(client)  # one run: process 1 opened none
    assert f"process 0 run_id={run.info.run_id}" in log.getvalue()
    one = make_trainer([MetricsLogger(1)], optax.sgd(0.1))  # the same batches, one process
    one.fit(make_batches(4), max_steps=4)
    logged = history(client, run.info.run_id, "train/loss")
    assert [s for s, _ in logged] == [1, 2, 3, 4]  # each step once: one writer
    np.testing.assert_allclose([v for _, v in logged], one.history.history["train/loss"],
                               rtol=1e-5)  # fmt: skip


def test_a_missing_tracker_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # what an absent package raises
    with pytest.raises(ImportError, match=r"pip install nnx-spmd-trainer\[mlflow\]"):
        MLflowLogger()


# -- W&B --------------------------------------------------------------------------------------
def wandb_records(path: Path) -> list:
    """The records of a ``.wandb`` file: W&B's LevelDB-style log (a 7-byte header, 32 KiB
    blocks of chunks, each chunk ``crc32c:u32 length:u16 type:u8``) of ``Record`` protos."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    records, chunk, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            records.append(record)
            chunk = b""
    return records


def wandb_history(path: Path) -> tuple[str, dict[str, list[tuple[int, float]]], dict]:
    """The run id, ``{key: [(step, value)]}`` of the history rows and the config updates
    of a ``.wandb`` file."""
    import json

    records = wandb_records(path)
    for _ in range(100):  # W&B's service may still be writing the file after finish()
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        time.sleep(0.1)
        records = wandb_records(path)
    run_id, rows, config = "", {}, {}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                     for i in record.history.item}  # fmt: skip
            for key, value in items.items():
                if not key.startswith("_"):
                    rows.setdefault(key, []).append((items["_step"], value))
    return run_id, rows, config


def test_wandb_offline_holds_the_metrics_and_a_resumed_run_keeps_its_id(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    ckpt, config = tmp_path / "ckpt", ml_collections.ConfigDict(CONFIG)
    first = WandbLogger(project="trackers", dir=tmp_path, settings=wandb.Settings(console="off"))
    trainer = make_trainer([MetricsLogger(2), OrbaxCheckpoint(ckpt), first], optax.sgd(0.1),
                           config=config)  # fmt: skip
    trainer.fit(make_batches(8), eval_data=make_batches(2, seed=1), max_steps=4,
                eval_every_n_steps=4)  # fmt: skip
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    run_id, rows, logged_config = wandb_history(next(run_dir.glob("run-*.wandb")))
    assert run_id == first.run_id
    assert {k: logged_config[k] for k in CONFIG_FLAT} == CONFIG_FLAT
    for key in ("train/loss", "eval/loss"):
        assert rows[key] == list(zip(trainer.history.steps[key], trainer.history.history[key],
                                     strict=True)), key  # fmt: skip
    assert (run_dir / "files" / "plan.txt").read_text().startswith("plan: DataParallel")

    second = WandbLogger(project="trackers", dir=tmp_path, settings=wandb.Settings(console="off"))
    resumed = make_trainer([MetricsLogger(2), OrbaxCheckpoint(ckpt), second], optax.sgd(0.1),
                           config=config)  # fmt: skip
    resumed.fit(make_batches(8), max_steps=8)
    assert second.run_id == first.run_id  # restored from the checkpoint
    (later,) = set((tmp_path / "wandb").glob("offline-run-*")) - {run_dir}
    run_id, rows, _ = wandb_history(next(later.glob("run-*.wandb")))
    assert run_id == first.run_id
    assert [s for s, _ in rows["train/loss"]] == [6, 8]
    np.testing.assert_allclose([v for _, v in rows["train/loss"]],
                               resumed.history.history["train/loss"][-2:], rtol=0)  # fmt: skip


# -- the CLI ----------------------------------------------------------------------------------
def test_the_cli_builds_the_loggers_config_loggers_names(tmp_path):
    config = _base.training_config()
    default = make_loggers(config, tmp_path)
    assert [type(c).__name__ for c in default] == ["TensorBoard", "CSVLogger"]
    config.loggers = "csv, mlflow"
    _, mlflow_one = make_loggers(config, tmp_path)
    assert mlflow_one.tracking_uri == f"sqlite:///{tmp_path.absolute() / 'mlflow.db'}"
    config.mlflow_uri = "http://127.0.0.1:5000"
    assert make_loggers(config, tmp_path)[1].tracking_uri == "http://127.0.0.1:5000"
    config.loggers = "tensorboard,mlfow"
    with pytest.raises(ConfigError, match=r"config.loggers=.*'mlfow' is not a logger; use"):
        make_loggers(config, tmp_path)


@pytest.mark.slow
def test_the_cli_logs_to_mlflow_what_it_writes_to_metrics_csv(tmp_path):
    import csv

    from conftest import environment_for_own_devices

    workdir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "nnx_spmd_trainer", f"--workdir={workdir}", "--config=mlp",
         "--config.max_steps=4", "--config.log_every_n_steps=1", "--config.loggers=csv,mlflow"],
        env=environment_for_own_devices(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert not (workdir / "tb").exists()  # not asked for
    with (workdir / "metrics.csv").open() as f:
        rows = [(int(r["step"]), float(r["train/loss"])) for r in csv.DictReader(f)
                if r.get("train/loss")]  # fmt: skip
    client = mlflow.MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.run_name == "run" and run.data.params["max_steps"] == "4"
    logged = history(client, run.info.run_id, "train/loss")
    assert [s for s, _ in logged] == [s for s, _ in rows] == [1, 2, 3, 4]
    np.testing.assert_allclose([v for _, v in logged], [v for _, v in rows], rtol=1e-6)
