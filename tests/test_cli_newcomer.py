"""What a newcomer met on the CLI (issue 45, item 9): a line before a long silence, a
learning-rate schedule changed by a resume, an evaluation of a workdir's checkpoints
(``nnx-spmd-train evaluate``) and a finished run run again."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import ml_collections
import pytest
from conftest import environment_for_own_devices
from test_callbacks_helpers import make_batches, make_trainer

from nnx_spmd_trainer.app import job_checks, tasks
from nnx_spmd_trainer.app.job_callbacks import SlowStepsNote
from nnx_spmd_trainer.callbacks import LambdaCallback


def _slow_steps(seconds: float) -> LambdaCallback:
    return LambdaCallback(on_train_batch_end=lambda step, logs: time.sleep(seconds))


def test_a_line_says_when_the_next_metrics_line_comes_if_it_is_far_off():
    lines: list[str] = []
    note = SlowStepsNote(50, after_s=1.0, print_fn=lines.append)
    make_trainer([_slow_steps(0.1), note]).fit(make_batches(6), max_steps=6)
    assert lines == []  # the run ends at step 6, ~0.2 s after the note's step 4: no wait
    make_trainer([_slow_steps(0.1), note]).fit(make_batches(40), max_steps=40)
    (line,) = lines  # the end of the run (step 40) comes before the metrics line of step 50
    assert re.fullmatch(
        r"step 4: 0\.\d\d s a step, so the next metrics line \(every 50 steps\) comes at "
        r"step 40, in ~\d+ s; --config.log_every_n_steps sets how often",
        line,
    ), line
    quiet: list[str] = []
    make_trainer([SlowStepsNote(50, print_fn=quiet.append)]).fit(make_batches(8), max_steps=8)
    assert quiet == []  # fast steps: nothing to say


# -- a schedule re-planned by a resume ------------------------------------------------------
def _workdir_of(tmp_path, step: int, **config) -> Path:
    """A workdir as a run leaves it: its config.json and a checkpoint step directory."""
    (tmp_path / "checkpoints" / str(step)).mkdir(parents=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


SCHEDULE = {"max_steps": 60, "learning_rate": 3e-3, "warmup_steps": 30, "end_lr_fraction": 0.1}


def test_a_resume_that_would_replan_the_schedule_is_refused_or_said(tmp_path):
    workdir = _workdir_of(tmp_path, 60, resume=True, **SCHEDULE)
    longer = ml_collections.ConfigDict({**SCHEDULE, "max_steps": 120, "resume": True})
    with pytest.raises(tasks.ConfigError) as refused:
        job_checks.schedule_change_on_resume(longer, workdir)
    message = str(refused.value)
    old_lr, new_lr = (float(tasks.schedule(ml_collections.ConfigDict(c))(60)) for c in (
        SCHEDULE, longer))  # fmt: skip
    assert new_lr > 5 * old_lr  # the jump the newcomer saw: 0.0003 -> 0.0019
    assert message == (
        f"config.max_steps=120 (was 60): the checkpoints in {workdir / 'checkpoints'} (step 60) "
        "were trained on the learning-rate schedule of the old values, and resuming would "
        f"re-plan it: the lr of step 61 would jump from {old_lr:.3g} to {new_lr:.3g}. Pass the "
        "old values to finish the run as planned, --config.replan_schedule=True to resume on "
        "the new schedule anyway, or --config.resume=False to start over."
    )
    longer.replan_schedule = True  # asked for: one line says it
    line = job_checks.schedule_change_on_resume(longer, workdir)
    assert line is not None and line.startswith(
        "resuming at step 60 on a re-planned learning-rate schedule: config.max_steps=120 (was "
    )
    same = ml_collections.ConfigDict({**SCHEDULE, "resume": True})
    assert job_checks.schedule_change_on_resume(same, workdir) is None
    # a constant learning rate: max_steps plans nothing, so a longer run resumes unsaid
    constant = {**SCHEDULE, "warmup_steps": 0, "end_lr_fraction": 1.0}
    workdir = _workdir_of(tmp_path / "constant", 60, **constant)
    longer_constant = ml_collections.ConfigDict({**constant, "max_steps": 120, "resume": True})
    assert job_checks.schedule_change_on_resume(longer_constant, workdir) is None
    longer.resume = False  # starting over: nothing resumed, nothing re-planned
    assert job_checks.schedule_change_on_resume(longer, workdir) is None


# -- end to end: refused, run again, evaluated ----------------------------------------------
MLP = ["--config=mlp", "--config.max_steps=4", "--config.eval_every_n_steps=0"]


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nnx_spmd_trainer", *args],
        cwd=cwd, env=environment_for_own_devices(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def _files(workdir: Path) -> dict[Path, tuple[int, int]]:
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in workdir.rglob("*")}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, str]:
    """A finished MLP run of 4 steps: its workdir and stdout."""
    base = tmp_path_factory.mktemp("trained")
    proc = _cli(*MLP, "--workdir=run", cwd=base)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return base / "run", proc.stdout


@pytest.mark.slow
def test_evaluate_prints_the_checkpoints_metrics_and_writes_nothing(trained):
    workdir, stdout = trained
    before = _files(workdir)
    proc = _cli("evaluate", str(workdir), cwd=workdir.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Warning" not in proc.stderr, proc.stderr[-3000:]
    final = stdout.split("final after 4 steps: eval loss ")[1].split()[0]
    lines = proc.stdout.splitlines()
    assert f"step 4: eval loss {final}, " in proc.stdout  # the trained run's own value
    assert "the label-frequency baseline" in proc.stdout
    (metrics,) = [line for line in lines if line.startswith("evaluated step 4 of ")]
    assert "eval/loss=" in metrics and "eval/accuracy=" in metrics
    assert not any(line.startswith(("speed", "time:", "input:", "final")) for line in lines)
    assert _files(workdir) == before
    missing = _cli("evaluate", str(workdir.parent / "nope"), cwd=workdir.parent)
    assert missing.returncode == 2
    (line,) = missing.stderr.strip().splitlines()
    assert line.startswith("nnx-spmd-train: error: evaluate: no checkpoint in ")


@pytest.mark.slow
def test_a_finished_run_run_again_says_so_without_a_warning_or_the_old_speed(trained):
    workdir, _ = trained
    again = _cli(*MLP, f"--workdir={workdir}", cwd=workdir.parent)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "UserWarning" not in again.stderr and "job.py" not in again.stderr, again.stderr
    lines = again.stdout.splitlines()
    assert any(line.startswith("nothing trained: the run in ") for line in lines), again.stdout
    assert not any(line.startswith(("speed", "time:", "input:")) for line in lines)
    longer = _cli(*MLP, "--config.max_steps=8", f"--workdir={workdir}", cwd=workdir.parent)
    assert longer.returncode == 2, longer.stderr[-3000:]
    (line,) = longer.stderr.strip().splitlines()
    assert line.startswith("nnx-spmd-train: error: config.max_steps=8 (was 4): ")


# -- MLflow: the UI's extra, and the new store's wait said -----------------------------------
def test_mlflow_ui_has_an_extra_and_a_new_store_is_announced(tmp_path, capsys):
    import tomllib

    from nnx_spmd_trainer.app.job_callbacks import make_loggers
    from nnx_spmd_trainer.callbacks import MLflowLogger

    root = Path(__file__).resolve().parents[1]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    # `mlflow ui` needs MLflow's server (Flask): the full package, not the [mlflow] client
    assert any(r.startswith("mlflow>=") for r in extras["mlflow-ui"])
    assert not any(r.startswith("mlflow>=") for r in extras["mlflow"])
    assert "[mlflow-ui]" in (MLflowLogger.__doc__ or "")
    config = ml_collections.ConfigDict({"loggers": "mlflow", "mlflow_uri": "", "resume": True})
    make_loggers(config, tmp_path)
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith(f"mlflow: a new store {tmp_path / 'mlflow.db'}: MLflow sets up")
    (tmp_path / "mlflow.db").touch()  # a store made by an earlier run: nothing to say
    make_loggers(config, tmp_path)
    assert capsys.readouterr().out == ""
