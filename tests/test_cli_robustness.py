"""The command line on a real cluster's bad days: several processes asked for a plan,
Ctrl-C in the middle of a save, a workdir gone read-only, a resume with another model.
Each is one line and an exit status, and the workdir is left as it was."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import environment_for_own_devices
from test_cli import _cli, load

from nnx_spmd_trainer import Trainer
from nnx_spmd_trainer.app import tasks
from nnx_spmd_trainer.callbacks import OrbaxCheckpoint

pytestmark = pytest.mark.slow

MLP = ["--config=mlp", "--config.max_steps=4", "--config.eval_every_n_steps=0"]


# -- item 2: a plan with several processes -----------------------------------------------------
@pytest.mark.serial  # two processes joining under Gloo's start deadline
def test_a_dry_run_of_two_processes_prints_one_plan_and_exits_0(tmp_path):
    """Process 1 asks only its own devices for their memory limit (it used to ask process
    0's and crash); process 0 prints the plan, the job prints it once."""
    proc = _cli(*MLP, "--num_processes=2", "--dry_run", "--workdir=run", cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    plans = [line for line in proc.stdout.splitlines() if " plan: " in f" {line}"]
    assert plans == ["[0] plan: Hybrid(DataParallel(4), TensorParallel(2)) on mesh "
                     "{'data': 4, 'model': 2} (cpu)"]  # fmt: skip
    assert "compiled step per device" in proc.stdout
    assert not (tmp_path / "run").exists()  # a dry run writes nothing


@pytest.mark.serial
def test_two_processes_place_the_axis_across_hosts_asks_for(tmp_path):
    """``--config.across_hosts`` reaches the strategy of a two-process job: its plan names
    it (``tests/test_mesh_hosts.py`` shows what ``across_hosts`` does to the mesh)."""
    proc = _cli(*MLP, "--config.strategy=data=2,model=4", "--config.across_hosts=data=2",
                "--num_processes=2", "--dry_run", "--workdir=run", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    plans = [line for line in proc.stdout.splitlines() if " plan: " in f" {line}"]
    assert plans == ["[0] plan: Hybrid(DataParallel(2), TensorParallel(4), across_hosts="
                     "{'data': 2}) on mesh {'data': 2, 'model': 4} (cpu)"]  # fmt: skip


# -- item 6: Ctrl-C inside a save -------------------------------------------------------------
# The CLI, with SIGINT sent DELAY seconds into Orbax's save of step AT: the signal lands
# in the save's blocking part, inside Orbax's own event loop and threads (where, from
# outside, it lands only now and then).
INTERRUPT = """
import os, signal, sys, threading
import orbax.checkpoint as ocp
from nnx_spmd_trainer.app import cli

at, delay = int(sys.argv[1]), float(sys.argv[2])
save = ocp.CheckpointManager.save

def save_interrupted(self, step, *args, **kwargs):
    if step == at:
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT)).start()
    return save(self, step, *args, **kwargs)

ocp.CheckpointManager.save = save_interrupted
cli.main(["nnx-spmd-train", *sys.argv[3:]])
"""
SAVING = [  # a save after every step
    "--config=mlp", "--config.max_steps=40", "--config.checkpoint_every_n_steps=1",
    "--config.log_every_n_steps=50", "--config.eval_every_n_steps=0",
]  # fmt: skip
EXIT_LINE = (
    "nnx-spmd-train: interrupted; the checkpoints committed so far are kept: "
    "run the same command to resume"
)


@pytest.mark.parametrize("delay", [0.005, 0.015])
def test_ctrl_c_inside_a_save_exits_130_at_once_with_nothing_after_the_exit_line(tmp_path, delay):
    """Orbax closes its event loop on the interrupted coroutines and may leave a thread of
    the save waiting for a signal that never comes: Python's exit used to wait for it (the
    run hung) or collect those coroutines ("Event loop is closed" tracebacks after the
    exit line). The steps committed before stay, and resume."""
    workdir = tmp_path / "run"
    env = environment_for_own_devices()  # the CLI sets it
    command = [sys.executable, "-c", INTERRUPT, "3", str(delay), f"--workdir={workdir}", *SAVING]
    try:
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"still running 120 s after it started: {hung.stderr!r}"[-3000:])
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert proc.stderr.rstrip("\n").splitlines()[-1] == EXIT_LINE, proc.stderr[-3000:]
    for noise in ("Traceback", "Event loop is closed", "Exception ignored", "destroyed"):
        assert noise not in proc.stderr, proc.stderr[-3000:]
    steps = OrbaxCheckpoint(workdir / "checkpoints").steps()
    assert steps[:2] == [1, 2] and steps[-1] <= 3  # step 3 committed only if its write was


GC_CALLBACK_INTERRUPTED = """
import gc, os, signal, time
from nnx_spmd_trainer.app.interrupts import interrupt
signal.signal(signal.SIGINT, interrupt)
def callback(phase, info):
    if phase == "start":
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # the handler runs at the next bytecode: inside this callback
gc.callbacks.append(callback)
try:
    gc.collect()
    gc.callbacks.remove(callback)
    time.sleep(10)
    print("not interrupted")
except KeyboardInterrupt:
    print("interrupted")
"""


def test_ctrl_c_inside_a_gc_callback_still_interrupts():
    """Ctrl-C that lands in a garbage-collection callback (JAX runs one; CI caught it in
    the save above, which then finished with exit 0): raised there, Python would print
    the KeyboardInterrupt and drop it; it is delivered again once the callback returns."""
    proc = subprocess.run([sys.executable, "-c", GC_CALLBACK_INTERRUPTED],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.stdout.strip() == "interrupted", proc.stdout + proc.stderr
    assert "Exception ignored" not in proc.stderr, proc.stderr


# -- items 7 and 8: a workdir the run must leave as it was ----------------------------------
def snapshot(root: Path) -> dict[str, tuple[bytes | None, int]]:
    """Every path under ``root``: its bytes (``None`` for a folder) and modification time."""
    return {
        str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
    }


def refused_in_one_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, (proc.stdout + proc.stderr)[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("nnx-spmd-train: error: "), line
    return line


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, str]:
    """A finished run of MLP (hidden_dim 256): its workdir and its stdout."""
    base = tmp_path_factory.mktemp("trained")
    proc = _cli(*MLP, "--workdir=run", cwd=base)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return base / "run", proc.stdout


@pytest.fixture
def workdir(tmp_path, trained) -> Path:
    """A copy of the trained run's workdir, for a test to run the command again in."""
    copy = tmp_path / "run"
    shutil.copytree(trained[0], copy)
    return copy


def test_a_resume_with_another_model_is_refused_before_anything_is_written(workdir):
    """The size of the model is checked against the checkpoints before the run writes:
    config.json stays the record of the run that wrote them, and every file is untouched
    (the run lock's too); a dry run of the new size still prints its plan, and the note."""
    before = snapshot(workdir)
    proc = _cli(*MLP, "--config.mlp.hidden_dim=128", f"--workdir={workdir}", cwd=workdir.parent)
    line = refused_in_one_line(proc)
    assert f"checkpoint step 4 at {workdir}/checkpoints/4 was written for another model" in line
    assert "model/fc1/bias: saved ((256,), 'float32'), here ((128,), 'float32')" in line
    assert f"trained with is in {workdir}/config.json; --config.resume=False starts over" in line
    assert snapshot(workdir) == before
    assert b'"hidden_dim": 256' in (workdir / "config.json").read_bytes()

    dry = _cli(*MLP, "--config.mlp.hidden_dim=128", f"--workdir={workdir}", "--dry_run",
               cwd=workdir.parent)  # fmt: skip
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert "plan: Hybrid(DataParallel(4), TensorParallel(2))" in dry.stdout
    assert "note: the run itself would be refused: checkpoint step 4" in dry.stdout
    assert snapshot(workdir) == before


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[Path]:
    """``path`` mounted read-only over itself (a bind mount): root cannot write there either,
    as on a remounted quota or a directory shared read-only. Root only."""
    if os.geteuid() != 0:
        pytest.skip("a read-only mount needs root (and chmod does not stop root)")
    mounted = subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {mounted.stderr.decode().strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], check=True)
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_read_only_checkpoint_directory_is_refused_and_still_read(workdir, trained):
    """The same command again, its checkpoints now read-only: one line naming the directory
    and the fix, exit 2, nothing changed (config.json, metrics.csv and the lock included).
    A dry run and an evaluation from the checkpoints read them as they are."""
    before = snapshot(workdir)
    checkpoints = workdir / "checkpoints"
    with read_only(checkpoints):
        proc = _cli(*MLP, f"--workdir={workdir}", cwd=workdir.parent)
        dry = _cli(*MLP, f"--workdir={workdir}", "--dry_run", cwd=workdir.parent)
        step, logs = evaluate_from(checkpoints)
        assert snapshot(workdir) == before
    line = refused_in_one_line(proc)
    assert line == (
        f"nnx-spmd-train: error: --workdir={workdir}: {checkpoints} is not writable (read-only "
        "file system) and this run would write there; make it writable or pass another "
        "--workdir (--dry_run, and evaluating its checkpoints with "
        "OrbaxCheckpoint(...).restore_into, only read it)."
    )
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert "plan: Hybrid(DataParallel(4), TensorParallel(2))" in dry.stdout
    assert f"note: the run itself would be refused: --workdir={workdir}: " in dry.stdout
    # The trained run's own last evaluation, from the read-only checkpoint.
    final = float(trained[1].split("final after 4 steps: eval loss ")[1].split()[0])
    assert step == 4 and logs["loss"] == pytest.approx(final, abs=1e-4)


def evaluate_from(checkpoints: Path) -> tuple[int | None, dict[str, float]]:
    """The MLP job's trainer, restored from ``checkpoints`` and evaluated, in this process."""
    config = load("mlp")
    strategy = tasks.parse_strategy(config.strategy)
    task = tasks.build_task(config, shard=strategy.data_shard(strategy.make_mesh()))
    trainer = Trainer(
        task.model, tasks.make_optimizer(config), strategy=strategy, loss_fn=task.loss_fn,
        metrics=tasks.Metrics,
    )  # fmt: skip
    step = OrbaxCheckpoint(checkpoints).restore_into(trainer)
    return step, trainer.evaluate(task.splits.eval)
