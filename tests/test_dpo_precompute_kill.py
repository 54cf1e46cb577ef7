"""DPO with precomputed reference log-probabilities, killed with SIGKILL after its first
checkpoint and started again: the second start reads the reference's table back from the
run's folder (the reference is not run again), and the final weights equal, bit for bit,
those of a run that was never stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import FAST_COMPILE

pytestmark = [pytest.mark.serial, pytest.mark.slow]

SCRIPT = """
import os, sys, time
import jax, numpy as np, optax
from flax import nnx
sys.path.insert(0, {tests!r})
from test_dpo import FSDP_TP, flat, make_model, toy_batches
from nnx_spmd_trainer import Callback
from nnx_spmd_trainer.callbacks import OrbaxCheckpoint
from nnx_spmd_trainer.post_training import DPOTrainer

class Slow(Callback):  # time to kill the run between its checkpoints; numerics untouched
    def on_train_batch_end(self, step, logs):
        time.sleep(0.5)

workdir = sys.argv[1]
path = os.path.join(workdir, "reference_logps.npz")
trainer = DPOTrainer(
    make_model, optax.sgd(0.5), beta=0.1, strategy=FSDP_TP, precompute_ref_log_probs=True,
    callbacks=[OrbaxCheckpoint(os.path.join(workdir, "checkpoints"), save_every_n_steps=2),
               Slow()],
)
batches = toy_batches(8, seed=11)
existed = os.path.exists(path)
trainer.precompute_reference_logps(batches, path=path)
print("reference table", "read back" if existed else "computed", flush=True)
trainer.fit(batches, max_steps=8)
params = flat(jax.device_get(nnx.to_pure_dict(nnx.state(trainer.model, nnx.Param))))
np.savez(os.path.join(workdir, "final.npz"), **params)
print("done", flush=True)
"""


def environment() -> dict[str, str]:
    """The tests' 8 simulated CPU devices for the script's process."""
    flags = f"--xla_force_host_platform_device_count=8 {FAST_COMPILE}"
    return {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}


def command(script: Path, workdir: Path) -> list[str]:
    return [sys.executable, str(script), str(workdir)]


def run(script: Path, workdir: Path) -> str:
    proc = subprocess.run(
        command(script, workdir),
        env=environment(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def test_sigkill_then_resume_reads_the_table_and_ends_bitwise(tmp_path):
    script = tmp_path / "dpo_run.py"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parent)))
    whole = tmp_path / "whole"
    assert "reference table computed" in run(script, whole)

    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        command(script, killed),
        env=environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    marker = killed / "checkpoints" / "2" / "commit_success.txt"
    deadline = time.monotonic() + 240
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert not (killed / "final.npz").exists()
    table = killed / "reference_logps.npz"
    written = table.stat().st_mtime_ns

    out = run(script, killed)
    assert "reference table read back" in out
    assert table.stat().st_mtime_ns == written  # not written again
    with np.load(whole / "final.npz") as want, np.load(killed / "final.npz") as got:
        assert sorted(want.files) == sorted(got.files)
        for key in want.files:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    with np.load(whole / "reference_logps.npz") as a, np.load(table) as b:
        np.testing.assert_array_equal(a["values"], b["values"])
