"""Jobs as a cluster runs them: SLURM's tasks, a coordinator named by host name, SIGTERM at
any moment (restore and compilation included), a task killed (slow, subprocesses).

No SLURM here: its tasks are started with the environment variables JAX's SLURM detection
reads. Every coordinator listens on loopback only (``JAX_COORDINATOR_BIND_ADDRESS``),
while the processes reach it by this machine's host name, as a cluster's would.
"""

from __future__ import annotations

import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_checkpoint_cli import assert_same_run, command, environment

from nnx_spmd_trainer import distributed

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # make test runs these alone
STEPS = ("--config.max_steps=12",)  # after test_checkpoint_cli's SMALL: a checkpoint every 4


def _port_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def slurm_job_id() -> int:
    """A job id whose coordinator port (JAX: 61440 + id % 4096) is free here now."""
    while True:
        job = random.randrange(10_000, 1_000_000)
        if _port_free(61440 + job % 4096):
            return job


def slurm_env(job: int, task: int, ntasks: int = 2) -> dict[str, str]:
    """What ``srun -N1 -n<ntasks>`` gives task ``task``, as far as JAX's detection reads it."""
    return {
        **environment(),  # no XLA_FLAGS: each task simulates its share of config.num_devices
        "SLURM_JOB_ID": str(job),
        "SLURM_PROCID": str(task),
        "SLURM_LOCALID": str(task),
        "SLURM_NTASKS": str(ntasks),
        "SLURM_STEP_NODELIST": socket.gethostname(),
        "SLURM_STEP_NUM_NODES": "1",
        "JAX_COORDINATOR_BIND_ADDRESS": f"127.0.0.1:{61440 + job % 4096}",
        "PYTHONUNBUFFERED": "1",  # srun's output is a pipe: lines as they come
    }


class Tasks:
    """The tasks of one SLURM job step, each started as the batch script would:
    ``python -m nnx_spmd_trainer --config=... --workdir=...``, no NNX_SPMD_* variable."""

    def __init__(self, workdir: Path, logs: Path) -> None:
        job = slurm_job_id()
        self.logs = [logs.with_name(f"{logs.name}.{task}") for task in range(2)]
        self.procs = []
        for task, log in enumerate(self.logs):
            with log.open("w") as out:
                self.procs.append(
                    subprocess.Popen(
                        command(workdir, *STEPS), env=slurm_env(job, task),
                        stdout=out, stderr=subprocess.STDOUT,
                    )
                )  # fmt: skip

    def output(self, task: int = 0) -> str:
        return self.logs[task].read_text()

    def wait_until(self, ready, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            assert all(p.poll() is None for p in self.procs), self.output()[-3000:]
            assert time.monotonic() < deadline, self.output()[-3000:]
            time.sleep(0.02)

    def signal_all(self, sig: int) -> None:  # what scancel -s TERM does
        for proc in self.procs:
            proc.send_signal(sig)

    def wait(self, timeout: float = 600) -> list[int]:
        return [proc.wait(timeout=timeout) for proc in self.procs]


def committed(workdir: Path) -> dict[int, set[str]]:
    """Each committed step, with the processes whose data position it holds."""
    checkpoints = workdir / "checkpoints"
    return {
        int(step.name): {p.name for p in (step / "data").glob("process_*")}
        for step in checkpoints.iterdir()
        if step.name.isdigit() and (step / "commit_success.txt").exists()
    }


def test_slurm_tasks_stop_at_one_step_on_sigterm_even_as_they_resume_then_resume_bitwise(
    tmp_path, two_process_job
):
    """``scancel -s TERM`` (or ``--signal=TERM@N``) reaches every task: both save the same
    step and exit 0. The resubmitted job, signalled as it starts (during the restore and
    the compilation, where JAX's sync point used to be unreachable), exits 0 within
    seconds, having saved at most the step it trained. The next one ends bitwise as an
    uninterrupted job of 2 processes (conftest's ``two_process_job``: the same job, its
    processes started by ``--num_processes=2`` rather than as SLURM tasks)."""
    workdir = tmp_path / "run"
    tasks = Tasks(workdir, tmp_path / "first")
    marker = workdir / "checkpoints" / "4" / "commit_success.txt"
    tasks.wait_until(marker.exists)
    tasks.signal_all(signal.SIGTERM)
    assert tasks.wait() == [0, 0], tasks.output()[-4000:]
    output = tasks.output()
    assert "on 8 cpu devices" in output  # 4 per task: each simulates its share, not all 8
    assert "[Gloo]" not in output and "peer ranks" not in output  # dropped in the task itself
    stopped = int(output.split("stopped by SIGTERM after step ")[1].split(",")[0])
    steps = committed(workdir)
    assert max(steps) == stopped
    assert steps[stopped] == {"process_0-of-2.json", "process_1-of-2.json"}  # both saved it

    before = committed(workdir)
    again = Tasks(workdir, tmp_path / "second")
    again.wait_until(lambda: "workdir" in again.output())  # its first line: restore is next
    again.signal_all(signal.SIGTERM)
    start = time.monotonic()
    assert again.wait() == [0, 0], again.output()[-4000:]
    assert time.monotonic() - start < 30, again.output()[-3000:]
    output = again.output()
    assert f"resuming from checkpoint step {stopped}" in output
    after = committed(workdir)
    if "before any step" in output:  # the notice beat the first check: nothing written
        assert after == before
    else:  # it came during the first step's compilation: that step, saved by both
        step = int(output.split("stopped by SIGTERM after step ")[1].split(",")[0])
        assert step == stopped + 1 and after[step] == before[stopped], output[-3000:]

    last = Tasks(workdir, tmp_path / "third")
    assert last.wait() == [0, 0], last.output()[-4000:]
    assert "final after 12 steps" in last.output()
    assert_same_run(workdir, two_process_job)


def two_processes_past_step_4(
    tmp_path: Path, coordinator: str, env: dict[str, str]
) -> tuple[list[subprocess.Popen[bytes]], list[Path]]:
    """A long 2-process job on ``coordinator``, once its checkpoint 4 is committed:
    (its processes, their log files)."""
    procs, logs = [], [tmp_path / f"log.{task}" for task in range(2)]
    for task, log in enumerate(logs):
        flags = [f"--coordinator_address={coordinator}", "--num_processes=2"]
        with log.open("w") as out:
            procs.append(
                subprocess.Popen(
                    command(tmp_path / "run", "--config.max_steps=10000", *flags,
                            f"--process_id={task}", export=False),
                    env=env, stdout=out, stderr=subprocess.STDOUT,
                )
            )  # fmt: skip
    marker = tmp_path / "run" / "checkpoints" / "4" / "commit_success.txt"
    deadline = time.monotonic() + 300
    while not marker.exists():
        assert all(p.poll() is None for p in procs), "".join(
            log.read_text()[-1500:] for log in logs
        )
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return procs, logs


def test_a_killed_process_is_named_within_30_s_on_a_host_name_coordinator(tmp_path):
    """The coordinator is this machine's host name (not 127.0.0.1), as on a cluster. Task 1
    is killed; task 0, sent SIGTERM right after (as ``srun -K`` does), exits 1 with one
    line naming process 1, within 30 s, with no abort dump."""
    port = distributed.free_port()
    coordinator = f"{socket.gethostname()}:{port}"
    env = {**environment(), "JAX_COORDINATOR_BIND_ADDRESS": f"127.0.0.1:{port}"}
    procs, logs = two_processes_past_step_4(tmp_path, coordinator, env)
    procs[1].send_signal(signal.SIGKILL)
    procs[0].send_signal(signal.SIGTERM)
    start = time.monotonic()
    status = procs[0].wait(timeout=120)
    seconds = time.monotonic() - start
    output = logs[0].read_text()
    assert status == distributed.LOST_PEER_STATUS, output[-3000:]
    assert seconds < 30, (seconds, output[-3000:])
    (line,) = [line for line in output.splitlines() if "stopped responding" in line]
    assert line.startswith("nnx_spmd_trainer: process 1 of 2 stopped responding")
    assert "Fatal Python error" not in output and "Traceback" not in output, output[-3000:]
    assert output.rstrip().endswith(line)  # the last word: nothing dumped after it
    procs[1].wait()


def test_a_killed_coordinator_leaves_jaxs_one_fatal_line_without_pythons_thread_dump(tmp_path):
    """Process 0 hosts the coordination service: killed, process 1 is aborted at once with
    one native fatal line (JAX's, naming the cause, or Gloo's: see below). Before, Python's
    fault handler (absl's) then dumped every thread over it."""
    coordinator = f"127.0.0.1:{distributed.free_port()}"
    procs, logs = two_processes_past_step_4(tmp_path, coordinator, environment())
    procs[0].send_signal(signal.SIGKILL)
    status = procs[1].wait(timeout=60)
    output = logs[1].read_text()
    assert status != 0, output[-3000:]
    # Two native detectors race to end process 1: JAX's coordination service (its one fatal
    # line), or, when process 1 is inside a collective as the socket breaks, Gloo's abort
    # (its "enforce fail" line; seen once, in a serial run of 2026-12-03). Either is one
    # line, with no dump.
    fatal = ("JAX distributed service detected fatal errors", "gloo::EnforceNotMet")
    assert any(line in output for line in fatal), output[-3000:]
    assert "Fatal Python error" not in output and "Thread 0x" not in output, output[-3000:]
    procs[0].wait()


def test_one_process_stopped_during_its_restore_exits_0_leaving_the_checkpoints(
    tmp_path, two_process_job
):
    """A SIGTERM during the restore (the run's first line is out; no step yet): exit 0,
    no step trained, nothing written to the checkpoints. The checkpoints are a copy of
    conftest's finished ``two_process_job`` (12 steps; one process resumes them)."""
    workdir = tmp_path / "run"
    shutil.copytree(two_process_job, workdir)
    files = _checkpoint_files(workdir)
    log = tmp_path / "log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            # 16 steps re-plan the 12-step schedule: allowed, the restore is what is stopped
            command(workdir, "--config.max_steps=16", "--config.replan_schedule=True",
                    export=False),
            env={**environment(), "PYTHONUNBUFFERED": "1"},
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    deadline = time.monotonic() + 300
    while "workdir" not in log.read_text():  # its first line: the restore comes next
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    output = log.read_text()
    assert "stopped by SIGTERM before any step (at step 12)" in output, output[-3000:]
    assert _checkpoint_files(workdir) == files


def _checkpoint_files(workdir: Path) -> dict[Path, int]:
    """Every file of the checkpoints with its modification time (the run lock aside: each
    run takes it, and writes its holder into it)."""
    found = (workdir / "checkpoints").rglob("*")
    return {p: p.stat().st_mtime_ns for p in found if p.name != ".run.lock"}


def test_gloo_notes_are_dropped_even_interleaved():
    """Gloo writes a note in eight pieces; two groups formed at once interleave them, which
    left a bare ``7`` line behind the launcher's line filter."""
    notes = distributed.GlooNotes()
    pieces = [
        "[Gloo] Rank ", "1", " is connected to ", "[Gloo] Rank ", "1", " is connected to ",
        "7", " peer ranks. ", "7", " peer ranks. ",
        "Expected number of connected peer ranks is : ",
        "Expected number of connected peer ranks is : ", "7", "\n", "7", "\n",
        "step 1: loss=2.5\n", "[Gloo] Rank 0 is connected to 1 peer ranks. ",
        "Expected number of connected peer ranks is : 1\n", "12\n",
    ]  # fmt: skip
    lines = "".join(pieces).splitlines(keepends=True)
    kept = [line for line in map(notes.keep, lines) if line is not None]
    assert kept == ["step 1: loss=2.5\n", "12\n"]  # a number of the program's own stays


def test_a_slurm_task_simulates_its_share_of_the_devices(monkeypatch):
    for name in (distributed.NUM_PROCESSES, distributed.COORDINATOR, distributed.PROCESS_ID):
        monkeypatch.delenv(name, raising=False)
    assert distributed.expected_processes() == 1
    for name, value in slurm_env(123, 1, ntasks=4).items():
        if name.startswith("SLURM_"):
            monkeypatch.setenv(name, value)
    assert distributed.expected_processes() == 4
    assert distributed.expected_processes(2) == 2  # --num_processes with a coordinator wins
    monkeypatch.setenv(distributed.PEER_TIMEOUT, "1")
    with pytest.raises(ValueError, match="NNX_SPMD_PEER_TIMEOUT_S='1'"):
        distributed.peer_timeout_s()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
