"""The default job's command, killed and run again: it resumes bitwise (slow, subprocesses)."""

import csv
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import environment_for_own_devices

SMALL = [
    "--config.max_steps=24",
    "--config.batch_size=16",
    "--config.log_every_n_steps=1",  # metrics.csv then holds every step's loss
    "--config.eval_every_n_steps=8",
    "--config.max_eval_batches=1",
    "--config.checkpoint_every_n_steps=4",
    "--config.gpt.seq_len=16",
    "--config.gpt.embed_dim=32",
    "--config.gpt.num_heads=4",
    "--config.gpt.ff_dim=64",
    "--config.gpt.num_layers=1",
]

pytestmark = pytest.mark.slow


def command(workdir: Path, *extra: str, export: bool = True) -> list[str]:
    exporting = [f"--export={workdir}-export"] if export else []
    return [
        sys.executable, "-m", "nnx_spmd_trainer", f"--workdir={workdir}", *exporting,
        *SMALL, *extra,
    ]  # fmt: skip


def environment() -> dict[str, str]:
    return environment_for_own_devices()  # the CLI sets it


def run_to_the_end(workdir: Path) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        command(workdir), env=environment(), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def start_and_stop(workdir: Path, sig: int, after_step: int) -> subprocess.Popen[str]:
    """Starts the job and sends ``sig`` once checkpoint ``after_step`` is committed."""
    proc = subprocess.Popen(
        command(workdir), env=environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    marker = workdir / "checkpoints" / str(after_step) / "commit_success.txt"
    deadline = time.monotonic() + 300
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the job ended before it could be stopped"
    proc.send_signal(sig)
    proc.wait(timeout=300)
    return proc


def losses(workdir: Path) -> list[tuple[int, str]]:
    """Every training-loss row, in file order, as written (the exact decimal printed):
    a row the killed run logged past its checkpoint would show up twice."""
    with (workdir / "metrics.csv").open(newline="") as f:
        return [(int(r["step"]), r["train/loss"]) for r in csv.DictReader(f) if r["train/loss"]]


def exported(workdir: Path) -> dict[str, np.ndarray]:
    tree = ocp.PyTreeCheckpointer().restore(Path(f"{workdir}-export").absolute())
    flat: dict[str, np.ndarray] = {}

    def walk(prefix: str, node: object) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(f"{prefix}/{key}", value)
        else:
            flat[prefix] = np.asarray(node)

    walk("", tree)
    return flat


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    workdir = tmp_path_factory.mktemp("whole") / "run"
    run_to_the_end(workdir)
    return workdir


def assert_same_run(workdir: Path, reference: Path) -> None:
    assert losses(workdir) == losses(reference)  # every step, bitwise (as printed)
    ours, theirs = exported(workdir), exported(reference)
    assert ours.keys() == theirs.keys()
    for key in ours:
        np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)


def test_sigkill_then_the_same_command_resumes_bitwise(tmp_path, uninterrupted):
    workdir = tmp_path / "run"
    killed = start_and_stop(workdir, signal.SIGKILL, after_step=8)
    assert killed.returncode == -signal.SIGKILL
    again = run_to_the_end(workdir)
    resumed_from = int(again.stdout.split("resuming from checkpoint step ")[1].split()[0])
    assert resumed_from >= 8
    assert "final after 24 steps" in again.stdout
    assert_same_run(workdir, uninterrupted)


def test_sigterm_saves_the_step_exits_0_and_a_restart_continues_bitwise(tmp_path, uninterrupted):
    workdir = tmp_path / "run"
    stopped = start_and_stop(workdir, signal.SIGTERM, after_step=8)
    output = stopped.stdout.read() if stopped.stdout else ""
    assert stopped.returncode == 0, output[-3000:]
    step = int(output.split("stopped by SIGTERM after step ")[1].split(",")[0])
    saved = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    assert saved[-1] == step  # the step it stopped at is the last checkpoint
    again = run_to_the_end(workdir)
    assert f"resuming from checkpoint step {step}" in again.stdout
    assert_same_run(workdir, uninterrupted)


def test_resume_false_starts_over_and_keeps_the_old_checkpoints(tmp_path, uninterrupted):
    workdir = tmp_path / "run"
    # A finished run's workdir: a copy of the module's, the same command run to the end
    # (running it again here would only repeat that run).
    shutil.copytree(uninterrupted, workdir)
    proc = subprocess.run(
        command(workdir, "--config.resume=False", "--config.max_steps=4", export=False),
        env=environment(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "starting over" in proc.stdout and "final after 4 steps" in proc.stdout
    (aside,) = workdir.parent.glob("run/checkpoints.before-*")
    assert "24" in {p.name for p in aside.iterdir()}


# -- a script of the user's, killed mid-epoch: a Grain pipeline and a plain list ---------------
SCRIPT = """
import os, signal, sys
sys.path.insert(0, {tests!r})
import grain, numpy as np, optax
from flax import nnx
from test_checkpoint import Dropped, FSDP_TP, grain_data
from toy_models import RecordLosses, classification_loss, flat_params
from nnx_spmd_trainer import Callback, Trainer
from nnx_spmd_trainer.callbacks import OrbaxCheckpoint

source, directory, kill_at, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
data = grain_data() if source == "grain" else list(grain_data())
losses = RecordLosses()
checkpoint = OrbaxCheckpoint(directory, save_every_n_steps=3)

class Kill(Callback):
    def on_step_end(self, step):
        if step == kill_at:
            checkpoint.manager.wait_until_finished()
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no final save

trainer = Trainer(lambda r: Dropped(r), optax.adamw(1e-2), strategy=FSDP_TP,
                  loss_fn=classification_loss, callbacks=[checkpoint, Kill(), losses])
trainer.fit(data, epochs=3)
params = flat_params(nnx.state(trainer.model, nnx.Param))
np.savez(out, losses=np.asarray(losses.losses), first=checkpoint.restored_step or 0,
         **{{k.replace("/", "."): v for k, v in params.items()}})
"""


def run_script(source: str, directory: Path, kill_at: int, out: Path) -> int:
    script = SCRIPT.format(tests=str(Path(__file__).parent))
    args = [sys.executable, "-c", script, source, str(directory), str(kill_at), str(out)]
    return subprocess.run(args, capture_output=True, text=True, timeout=600).returncode


@pytest.mark.parametrize("source", ["grain", "list"])
def test_a_script_killed_mid_epoch_resumes_bitwise(tmp_path, source):
    assert run_script(source, tmp_path / "whole", 0, tmp_path / "whole.npz") == 0
    assert run_script(source, tmp_path / "ckpt", 8, tmp_path / "x.npz") == -signal.SIGKILL
    assert run_script(source, tmp_path / "ckpt", 0, tmp_path / "resumed.npz") == 0
    whole, resumed = np.load(tmp_path / "whole.npz"), np.load(tmp_path / "resumed.npz")
    assert int(resumed["first"]) == 6  # mid-epoch 2: 5 batches an epoch
    np.testing.assert_array_equal(resumed["losses"], whole["losses"][6:])
    for key in whole.files:
        if key not in ("losses", "first"):
            np.testing.assert_array_equal(resumed[key], whole[key], err_msg=key)


def test_a_sigterm_during_the_imports_stops_before_any_step_and_exits_0(tmp_path):
    # Before: the command died of it (exit 143) while JAX was still being imported.
    script = Path(sys.executable).parent / "nnx-spmd-train"  # the entry point users run
    workdir = tmp_path / "run"
    proc = subprocess.Popen(
        [str(script), f"--workdir={workdir}", *SMALL], env=environment(),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    time.sleep(0.3)  # importing JAX alone takes longer
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-3000:]
    assert "stopped by SIGTERM before any step" in output, output[-3000:]
    assert not list((workdir / "checkpoints").glob("*/commit_success.txt"))
