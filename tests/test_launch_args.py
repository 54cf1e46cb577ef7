"""``--num_processes`` read in every form absl accepts, and taken out of the command each
launched process runs (``app.cli.local_launch``; no process is started here)."""

from __future__ import annotations

import sys

import pytest

from nnx_spmd_trainer import distributed
from nnx_spmd_trainer.app.cli import local_launch

REST = ["--dry_run", "--config.max_steps=3", "--workdir", "run"]


@pytest.fixture(autouse=True)
def _not_a_launched_process(monkeypatch):
    monkeypatch.delenv(distributed.PROCESS_ID, raising=False)


@pytest.mark.parametrize(
    "form",
    [
        ["--num_processes=2"],
        ["--num_processes", "2"],  # the space form: once read as no launch at all
        ["-num_processes", "2"],
        ["-num_processes=2"],
    ],
    ids=["equals", "space", "one-dash-space", "one-dash-equals"],
)
def test_every_form_launches_two_processes_given_the_rest_of_the_command(form):
    launch = local_launch(["nnx-spmd-train", *form, *REST])
    assert launch is not None, form
    assert launch.num_processes == 2
    assert launch.command == [sys.executable, "-m", "nnx_spmd_trainer", *REST]


def test_one_process_a_coordinator_or_a_launched_process_launches_nothing(monkeypatch):
    assert local_launch(["nnx-spmd-train", "--dry_run"]) is None
    assert local_launch(["nnx-spmd-train", "--num_processes", "1"]) is None
    # With a coordinator (either form) this process joins a job started elsewhere.
    joined = ["--num_processes", "2", "--coordinator_address", "10.0.0.1:1234"]
    assert local_launch(["nnx-spmd-train", *joined, "--process_id=0"]) is None
    monkeypatch.setenv(distributed.PROCESS_ID, "1")
    assert local_launch(["nnx-spmd-train", "--num_processes", "2"]) is None


def test_a_count_absl_refuses_is_one_line_and_status_2(capsys):
    with pytest.raises(SystemExit) as exited:
        local_launch(["nnx-spmd-train", "--num_processes", "two"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("nnx-spmd-train: error: ") and "num_processes" in err, err
    assert err.count("\n") == 1, err
