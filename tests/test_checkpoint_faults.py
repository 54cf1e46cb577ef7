"""Checkpoint saves that fail: a read-only directory, a full disk, Ctrl-C mid-save.

Each runs the CLI in a subprocess with the fault injected between two saves, and
bounds the time from the fault to the exit: a hang fails the test, never the suite.
"""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import optax
import pytest
from conftest import environment_for_own_devices
from toy_models import Net, classification_loss, make_batches

from nnx_spmd_trainer import Trainer
from nnx_spmd_trainer.callbacks import CheckpointWriteError, OrbaxCheckpoint

pytestmark = pytest.mark.slow

# The shipped MLP job, small: steps 4 and 8 are saved, and the fault comes at step 8's save.
RUN = [
    "--config=mlp", "--config.max_steps=8", "--config.checkpoint_every_n_steps=4",
    "--config.log_every_n_steps=4", "--config.eval_every_n_steps=0",
]  # fmt: skip
FAULT_AT = 8

# The CLI, with the fault injected at the save of step FAULT_AT; MARKER is touched then.
INJECT = """
import os, signal, subprocess, sys, time
from pathlib import Path
import orbax.checkpoint as ocp
from nnx_spmd_trainer.app import cli
from nnx_spmd_trainer.callbacks import OrbaxCheckpoint

fault, at, marker = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
save, manager_save = OrbaxCheckpoint.save, ocp.CheckpointManager.save

def read_only(directory):  # root writes past permission bits, not past the immutable flag
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i", str(directory)], check=True)
    else:
        os.chmod(directory, 0o555)

def fill(directory):  # on the small disk the test mounted; 64 MiB at most, whatever the disk
    try:
        with open(directory / ".filler", "wb") as f:
            for _ in range(1024):
                f.write(bytes(1 << 16))
                f.flush()
    except OSError:
        return
    raise RuntimeError(f"{directory} is not on a small disk: 64 MiB fitted")

def faulty_save(self, step, **kwargs):  # the disk changes between two saves
    if step == at and fault in ("read-only", "full"):
        self.manager.wait_until_finished()
        (read_only if fault == "read-only" else fill)(self.directory)
        marker.touch()
    return save(self, step, **kwargs)

def interrupted_save(self, step, *args, **kwargs):  # Ctrl-C once the write is under way
    saved = manager_save(self, step, *args, **kwargs)
    if step == at and fault == "sigint":
        marker.touch()
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
    return saved

OrbaxCheckpoint.save = faulty_save
ocp.CheckpointManager.save = interrupted_save
cli.main(["nnx-spmd-train", *sys.argv[4:]])
"""


def environment() -> dict[str, str]:
    return environment_for_own_devices()  # the CLI sets it


def run_with_fault(tmp_path: Path, workdir: Path, fault: str) -> tuple[int, str]:
    """(exit status, stdout + stderr); a run still alive 30 s after the fault is killed
    and fails the test."""
    marker, log = tmp_path / "fault", tmp_path / "log.txt"
    args = [sys.executable, "-c", INJECT, fault, str(FAULT_AT), str(marker)]
    with log.open("w") as out:
        proc = subprocess.Popen(
            [*args, f"--workdir={workdir}", *RUN],
            env=environment(), stdout=out, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 300
            while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert marker.exists(), f"the fault never came:\n{log.read_text()[-3000:]}"
            try:
                status = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pytest.fail(f"still running 30 s after the fault:\n{log.read_text()[-3000:]}")
            return status, log.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if "could not write checkpoint" in line]


def test_a_read_only_checkpoint_directory_ends_the_run_at_once_naming_it(tmp_path):
    if os.geteuid() == 0 and shutil.which("chattr") is None:
        pytest.skip("root ignores permissions, and no chattr is here to make a directory immutable")
    workdir = tmp_path / "run"
    checkpoints = workdir / "checkpoints"
    try:
        status, output = run_with_fault(tmp_path, workdir, "read-only")
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(checkpoints)], check=False)
        else:
            checkpoints.chmod(0o755)
    assert status == 1, output[-3000:]
    (line,) = error_lines(output)  # the cause as the OS gives it: EPERM, EACCES or EROFS
    assert line.startswith(
        f"nnx-spmd-train: error: could not write checkpoint step {FAULT_AT} to {checkpoints} "
        "(the directory is not writable: "
    ), output[-3000:]
    assert line.endswith("); steps [4] there are intact")
    assert "Traceback" not in output
    assert OrbaxCheckpoint(checkpoints).steps() == [4]


@contextlib.contextmanager
def small_disk(path: Path, size: str):
    """A ``tmpfs`` of ``size`` mounted at ``path``: a disk that fills up (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    path.mkdir(parents=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_full_disk_is_one_line_naming_the_step_the_path_and_the_intact_steps(tmp_path):
    workdir = tmp_path / "run"
    # Only the checkpoints' disk fills: the other writers (TensorBoard) have their own.
    with small_disk(workdir / "checkpoints", "8m") as checkpoints:
        status, output = run_with_fault(tmp_path, workdir, "full")
        steps = OrbaxCheckpoint(checkpoints).steps()
    assert status == 1, output[-3000:]
    assert error_lines(output) == [
        f"nnx-spmd-train: error: could not write checkpoint step {FAULT_AT} to {checkpoints} "
        "(No space left on device); steps [4] there are intact"
    ], output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert steps == [4]


def test_ctrl_c_during_an_async_save_exits_130_at_once_and_the_next_run_resumes(tmp_path):
    workdir = tmp_path / "run"
    status, output = run_with_fault(tmp_path, workdir, "sigint")
    assert status == 128 + signal.SIGINT, output[-3000:]
    assert "interrupted; the checkpoints committed so far are kept" in output
    assert OrbaxCheckpoint(workdir / "checkpoints").steps() == [4]  # step 8 was dropped

    again = subprocess.run(
        [sys.executable, "-m", "nnx_spmd_trainer", f"--workdir={workdir}", *RUN],
        env=environment(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    assert "resuming from checkpoint step 4" in again.stdout
    assert "final after 8 steps" in again.stdout
    assert OrbaxCheckpoint(workdir / "checkpoints").steps() == [4, 8]


def test_a_read_only_directory_outside_the_cli_is_a_checkpoint_write_error_before_any_step(
    tmp_path,
):
    # Before: a raw OSError from RunLock.acquire.
    if os.geteuid() == 0 and shutil.which("chattr") is None:
        pytest.skip("root ignores permissions, and no chattr is here to make a directory immutable")
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i", str(directory)], check=True)
    else:
        directory.chmod(0o555)
    trainer = Trainer(Net, optax.sgd(0.1), loss_fn=classification_loss,
                      callbacks=[OrbaxCheckpoint(directory)])  # fmt: skip
    try:
        with pytest.raises(CheckpointWriteError, match=rf"OrbaxCheckpoint cannot write {directory}"
                           r" \(.*\).*nothing was trained"):  # fmt: skip
            trainer.fit(make_batches(2), max_steps=2)
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(directory)], check=False)
        else:
            directory.chmod(0o755)
    assert trainer.step == 0
