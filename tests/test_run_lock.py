"""A second run on a directory in use is refused at once, naming the first; a crash frees it."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from test_checkpoint import grain_data, trainer_for
from test_checkpoint_cli import SMALL, environment

from nnx_spmd_trainer import DirectoryInUse, RunLock
from nnx_spmd_trainer.callbacks import OrbaxCheckpoint
from nnx_spmd_trainer.io import run_lock

# The package's run_lock.py loaded by its path: the same RunLock, without importing JAX
# (the package's __init__) in a process that only holds a lock.
HOLD = textwrap.dedent(
    """
    import importlib.util, sys, time
    spec = importlib.util.spec_from_file_location("run_lock", sys.argv[2])
    run_lock = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_lock)
    run_lock.RunLock(sys.argv[1]).acquire()
    print("held", flush=True)
    time.sleep(120)
    """
)


def hold_in_another_process(directory: Path) -> subprocess.Popen[str]:
    module = Path(run_lock.__file__)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(directory), str(module)], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


def test_a_checkpoint_directory_in_use_is_refused_naming_its_process_and_freed_by_a_crash(
    tmp_path,
):
    holder = hold_in_another_process(tmp_path)
    try:
        trainer = trainer_for(callbacks=[OrbaxCheckpoint(tmp_path, save_every_n_steps=1)])
        with pytest.raises(DirectoryInUse, match=rf"pid {holder.pid} on "):
            trainer.fit(grain_data(), max_steps=2)
        assert OrbaxCheckpoint(tmp_path).steps() == []  # nothing was written
    finally:
        holder.send_signal(signal.SIGKILL)  # a crash: the kernel drops the lock
        holder.wait()
    checkpoint = OrbaxCheckpoint(tmp_path, save_every_n_steps=1)
    trainer_for(callbacks=[checkpoint]).fit(grain_data(), max_steps=2)
    assert checkpoint.steps() == [1, 2]
    assert not checkpoint._lock.held  # released at the end of fit
    RunLock(tmp_path).acquire().release()  # and so free for the next run


def test_two_trainers_of_one_process_on_one_directory_are_refused_too(tmp_path):
    first = RunLock(tmp_path).acquire()
    try:
        with pytest.raises(DirectoryInUse, match=f"pid {os.getpid()} "):
            RunLock(tmp_path).acquire()
    finally:
        first.release()


def _make_read_only(directory: Path) -> None:  # root writes past permission bits, not chattr +i
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i", str(directory)], check=True)
    else:
        os.chmod(directory, 0o555)


def test_a_directory_that_cannot_be_written_is_named_with_the_fix_keeping_the_error_type(
    tmp_path,
):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(NotADirectoryError, match=r"run lock .*a_file.*permissions"):
        RunLock(tmp_path / "a_file" / "run").acquire()
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    _make_read_only(read_only)
    try:
        with pytest.raises(PermissionError, match=rf"cannot write the run lock {read_only}/"):
            RunLock(read_only).acquire()
        assert not (read_only / RunLock.FILE).exists()
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(read_only)], check=True)
        os.chmod(read_only, 0o755)


def _latest_state(checkpoints: Path) -> list[np.ndarray]:
    options = ocp.CheckpointManagerOptions(read_only=True)
    manager = ocp.CheckpointManager(checkpoints, options=options)
    step = manager.latest_step()
    restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    leaves = jax.tree.leaves(restored["state"])
    return [np.asarray(x) for x in leaves if jax.numpy.issubdtype(x.dtype, jax.numpy.floating)]


@pytest.mark.slow
def test_a_second_cli_run_on_a_busy_workdir_is_refused_in_one_line_and_the_first_finishes(
    tmp_path,
):
    workdir = tmp_path / "run"
    first = subprocess.Popen(
        [sys.executable, "-m", "nnx_spmd_trainer", f"--workdir={workdir}", *SMALL],
        env=environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    marker = workdir / "checkpoints" / "4" / "commit_success.txt"
    deadline = time.monotonic() + 300
    while not marker.exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    first.send_signal(signal.SIGSTOP)  # mid-run, for as long as the second one takes
    try:
        before = sorted(p.name for p in (workdir / "checkpoints").iterdir())
        second = subprocess.run(
            [sys.executable, "-m", "nnx_spmd_trainer", f"--workdir={workdir}", *SMALL],
            env=environment(), capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        after = sorted(p.name for p in (workdir / "checkpoints").iterdir())
    finally:
        first.send_signal(signal.SIGCONT)
    out, _ = first.communicate(timeout=300)
    assert second.returncode == 2, second.stdout + second.stderr
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1, second.stderr
    assert f"--workdir={workdir}" in lines[0] and f"pid {first.pid} on " in lines[0]
    assert after == before  # the second run touched nothing
    assert first.returncode == 0, out[-3000:]
    saved = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    assert saved[-1] == 24 and not list(workdir.glob("checkpoints/*.damaged*"))
    state = _latest_state(workdir / "checkpoints")
    assert state and all(np.isfinite(leaf).all() for leaf in state)
