"""Two JAX processes on 127.0.0.1 (4 simulated devices each) train like one process of 8."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from mp_runs import AUTO, STRATEGIES, train, train_grain
from test_cli import _cli

from nnx_spmd_trainer import distributed

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # make test runs these alone
WORKER = Path(__file__).parent / "mp_worker.py"


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> np.lib.npyio.NpzFile:
    out = tmp_path_factory.mktemp("mp") / "results.npz"
    log = io.StringIO()
    status = distributed.Launch([sys.executable, str(WORKER), str(out)], 2, out=log).run()
    assert status == 0, log.getvalue()[-4000:]
    # Every line the processes print comes back prefixed with its process.
    assert all(line.startswith(("[0] ", "[1] ")) for line in log.getvalue().splitlines())
    return np.load(out)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_two_processes_match_one_process_of_eight_devices(two_processes, name):
    one = train(name)  # the same run, here: one process feeding whole batches
    assert int(one[f"{name}/shard"][1]) == 1
    np.testing.assert_allclose(two_processes[f"{name}/losses"], one[f"{name}/losses"], rtol=1e-5)
    for key in [k for k in one if "/params/" in k]:
        np.testing.assert_allclose(two_processes[key], one[key], rtol=1e-4, atol=1e-5, err_msg=key)
    # Over 8 devices the model axis spans both processes: both feed the whole batch.
    expected_shards = {"tp8": 1}.get(name, 2)
    assert int(two_processes[f"{name}/shard"][1]) == expected_shards


def test_a_process_feeding_rows_against_data_shard_fails_every_process_before_a_step(tmp_path):
    """Under a model axis over both processes, data_shard says both feed the whole batch;
    each feeding its own half would train on a batch nobody fed. Both processes raise,
    naming process 1 and the fix, before any step runs (test_two_processes_match_one_
    process_of_eight_devices[tp8] is the same run fed right)."""
    report, log = tmp_path / "report", io.StringIO()
    command = [sys.executable, str(WORKER), str(report), "--a-slice-per-process"]
    start = time.monotonic()
    status = distributed.Launch(command, 2, out=log).run()
    assert status != 0, log.getvalue()[-4000:]
    assert time.monotonic() - start < 240  # quick: no process waits on a hung collective
    for process in (0, 1):
        text = (tmp_path / f"report.{process}").read_text()  # every process raised
        assert text.startswith("ShardingError: nnx_spmd_trainer: process 1 fed a batch unlike")
        assert "process 0's (leaves ['x'], ['y'])" in text
        assert "DataShard(index=0, count=1)" in text and "every process feeds the whole" in text
        assert "rows[index::count]" in text  # the fix
        assert text.endswith("steps run: 0\n")


def test_launcher_stops_the_others_and_names_the_failed_process(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        "import os, sys, time\n"
        "if os.environ['NNX_SPMD_PROCESS_ID'] == '1':\n"
        "    print('process 1 fails', flush=True); sys.exit(3)\n"
        "time.sleep(120)\n"
    )
    log = io.StringIO()
    start = time.monotonic()
    status = distributed.Launch([sys.executable, str(script)], 2, grace_s=5, out=log).run()
    assert status == 3
    assert time.monotonic() - start < 30  # the sleeper was stopped, not waited for
    assert "[1] process 1 fails" in log.getvalue()
    assert "process 1 of 2 exited with status 3; stopping the others" in log.getvalue()


def test_launched_processes_die_with_a_killed_launcher(tmp_path):
    """SIGKILL to the launcher (nothing of it runs) still ends its children."""
    pids = tmp_path / "pids"
    script = tmp_path / "job.py"
    script.write_text(
        "import os, time\n"
        f"open({str(pids)!r} + os.environ['NNX_SPMD_PROCESS_ID'], 'w').write(str(os.getpid()))\n"
        "time.sleep(120)\n"
    )
    code = (
        "import sys; from nnx_spmd_trainer.distributed import Launch; "
        f"sys.exit(Launch([sys.executable, {str(script)!r}], 2).run())"
    )
    launcher = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"pids{i}").exists() for i in range(2)):
        assert time.monotonic() < deadline, "the children did not start"
        time.sleep(0.2)
    children = [int((tmp_path / f"pids{i}").read_text()) for i in range(2)]
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in children):
        assert time.monotonic() < deadline, "a child outlived its launcher"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead but not reaped (its parent was the killed launcher).
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "zombie" not in status.read_text()


def test_split_host_devices_and_its_error():
    flags = "--foo --xla_force_host_platform_device_count=8"
    assert distributed.split_host_devices(flags, 2).endswith("device_count=4")
    with pytest.raises(ValueError, match="8 simulated devices .* do not split between 3"):
        distributed.split_host_devices(flags, 3)


def test_a_single_process_never_joins_the_runtime(monkeypatch):
    for name in (distributed.COORDINATOR, distributed.NUM_PROCESSES, distributed.PROCESS_ID):
        monkeypatch.delenv(name, raising=False)
    assert distributed.initialize() is False
    assert distributed.initialize("127.0.0.1:1234", 1, 0) is False
    with pytest.raises(ValueError, match="need all of coordinator_address"):
        distributed.initialize("127.0.0.1:1234", 2)


SMALL_GPT = [
    "--config.max_steps=3",
    "--config.batch_size=16",
    "--config.log_every_n_steps=1",
    "--config.max_eval_batches=2",
    "--config.gpt.seq_len=16",
    "--config.gpt.embed_dim=32",
    "--config.gpt.ff_dim=64",
    "--config.gpt.num_layers=1",
]


def _final(stdout: str) -> tuple[str, float]:
    (line,) = [line for line in stdout.splitlines() if "final after" in line]
    return line, float(line.split("eval loss ")[1].split()[0])


def _losses(workdir: Path) -> dict[int, float]:
    """Each step's training loss in ``metrics.csv`` (the last row of a step logged twice)."""
    from test_checkpoint_cli import losses

    return {step: float(loss) for step, loss in losses(workdir)}


def _assert_two_process_output(two: subprocess.CompletedProcess, steps: int) -> None:
    """What a 2-process CLI run prints: process 0 reports, 8 devices, the data-wait share."""
    assert two.returncode == 0, (two.stdout + two.stderr)[-3000:]
    line, _ = _final(two.stdout)
    assert line.startswith(f"[0] final after {steps} steps: eval loss")  # process 0 reports
    assert "on 8 cpu devices" in two.stdout  # 4 in each process, 8 in the job
    assert not [line for line in two.stdout.splitlines() if line.startswith("[1] step")]
    assert "[0] input: the steps waited for batches" in two.stdout  # the data-wait share


# A model axis over all 8 devices, whose data split is not plain data parallel (the
# public API test above covers DataParallel and FSDP; the default job's fsdp x model,
# packed, is the next test's).
def test_the_cli_on_two_processes_ends_like_one_process(tmp_path):
    one = _cli("--config=tp", "--workdir=one", *SMALL_GPT, cwd=tmp_path)
    two = _cli("--config=tp", "--workdir=two", "--num_processes=2", *SMALL_GPT, cwd=tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    _assert_two_process_output(two, 3)
    assert _final(two.stdout)[1] == pytest.approx(_final(one.stdout)[1], abs=2e-4)
    by_one, by_two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert sorted(by_two) == sorted(by_one) == [1, 2, 3]  # every step, the same rows
    assert [by_two[s] for s in by_one] == pytest.approx(list(by_one.values()), rel=1e-5)
    assert (tmp_path / "two" / "metrics.csv").exists()


def test_a_packed_run_on_two_processes_equals_one_and_resumes_on_one_on_the_same_rows(
    tmp_path,
):
    """The default job (packed BPE, fsdp x model): 2 processes x 4 devices train its first
    2 steps as 1 process x 8 does, and their checkpoint continues on 1 process as the
    1-process run does, to the same final eval loss: the data position is the step
    (data.PackedBlocks gives every process count the same rows). One run of each serves
    both checks (each CLI run costs about half a minute here)."""
    constant_lr = ("--config.warmup_steps=0", "--config.end_lr_fraction=1.0")  # no re-plan
    small = [*SMALL_GPT[1:], "--config.max_eval_batches=1", *constant_lr]
    whole = _cli("--workdir=whole", "--config.max_steps=4", *small, cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    two = _cli("--workdir=moved", "--num_processes=2", "--config.max_steps=2", *small, cwd=tmp_path)
    _assert_two_process_output(two, 2)
    expected, by_two = _losses(tmp_path / "whole"), _losses(tmp_path / "moved")
    assert sorted(by_two) == [1, 2]
    assert [by_two[s] for s in (1, 2)] == pytest.approx([expected[1], expected[2]], rel=1e-5)
    one = _cli("--workdir=moved", "--config.max_steps=4", *small, cwd=tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    assert "resuming from checkpoint step 2" in one.stdout, one.stdout[-3000:]
    moved = _losses(tmp_path / "moved")
    assert sorted(moved) == sorted(expected) == [1, 2, 3, 4]
    assert [moved[s] for s in expected] == pytest.approx(list(expected.values()), rel=1e-5)
    assert _final(one.stdout)[1] == pytest.approx(_final(whole.stdout)[1], abs=2e-4)


def _two_process_grain(tmp_path: Path, checkpoints: Path, max_steps: int, *flags: str) -> dict:
    out = tmp_path / f"grain-{max_steps}.npz"
    log = io.StringIO()
    command = [
        sys.executable, str(WORKER), str(out), "--grain", str(checkpoints), str(max_steps), *flags
    ]  # fmt: skip
    assert distributed.Launch(command, 2, out=log).run() == 0, log.getvalue()[-4000:]
    return dict(np.load(out))


def _assert_same_run(resumed: dict, whole: dict, from_step: int) -> None:
    """The resumed steps took the same rows, losses and parameters as the uninterrupted run."""
    np.testing.assert_array_equal(resumed["rows"], whole["rows"][from_step:])
    np.testing.assert_allclose(resumed["losses"], whole["losses"][from_step:], rtol=1e-5)
    for key in [k for k in whole if k.startswith("params/")]:
        np.testing.assert_allclose(resumed[key], whole[key], rtol=1e-4, atol=1e-6, err_msg=key)


def test_a_checkpoint_moves_between_process_counts_with_its_data_position(tmp_path):
    whole = train_grain(tmp_path / "whole", 6)  # one process, uninterrupted
    assert int(whole["restored_step"]) == -1

    # Written by 2 processes at step 3, resumed by 1.
    first = _two_process_grain(tmp_path, tmp_path / "by-two", 3)
    np.testing.assert_array_equal(first["rows"], whole["rows"][:3])
    resumed = train_grain(tmp_path / "by-two", 6)
    assert int(resumed["restored_step"]) == 3
    _assert_same_run(resumed, whole, 3)

    # Written by 1 process at step 3, resumed by 2.
    train_grain(tmp_path / "by-one", 3)
    resumed = _two_process_grain(tmp_path, tmp_path / "by-one", 6)
    assert int(resumed["restored_step"]) == 3
    _assert_same_run(resumed, whole, 3)


def test_a_pipeline_counting_rows_resumes_on_another_process_count(tmp_path):
    """``to_iter_dataset().batch(n)`` keeps its position in rows, not batches: written by
    2 processes at step 3, it resumes on 1 at the rows an uninterrupted run takes."""
    whole = train_grain(tmp_path / "whole", 6, rows_counted=True)
    first = _two_process_grain(tmp_path, tmp_path / "by-two", 3, "--rows-counted")
    np.testing.assert_array_equal(first["rows"], whole["rows"][:3])
    resumed = train_grain(tmp_path / "by-two", 6, rows_counted=True)
    assert int(resumed["restored_step"]) == 3
    _assert_same_run(resumed, whole, 3)


def test_a_two_process_auto_run_resumes_in_its_layout_untimed(tmp_path):
    """``strategy="auto"`` on 2 processes: the resumed job keeps the layout it saved in
    (every process, nothing timed) and ends as one process does in that layout."""
    first = _two_process_grain(tmp_path, tmp_path / "auto", 3, "--auto")
    assert not first["resumed_layout"]
    resumed = _two_process_grain(tmp_path, tmp_path / "auto", 6, "--auto")
    assert resumed["resumed_layout"] and int(resumed["restored_step"]) == 3
    assert str(resumed["strategy"]) == str(first["strategy"])
    (layout,) = [s for s in AUTO.candidates or () if repr(s) == str(first["strategy"])]
    whole = train_grain(tmp_path / "whole", 6, strategy=layout)  # one process, not timed
    np.testing.assert_array_equal(first["rows"], whole["rows"][:3])
    _assert_same_run(resumed, whole, 3)


# -- signals to one process of a launched CLI job -------------------------------------------
def _children(launcher: subprocess.Popen) -> dict[int, int]:
    """``{process index: pid}`` of a launcher's children, from /proc."""
    pids = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
    found = {}
    for pid in map(int, pids):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        index = [e for e in environ if e.startswith(b"NNX_SPMD_PROCESS_ID=")]
        found[int(index[0].split(b"=")[1])] = pid
    return found


SHORT = ("--num_processes=2", "--config.max_steps=12")  # after test_checkpoint_cli's SMALL


def _start_and_signal_process_1(workdir: Path, sig: int, after_step: int):
    from test_checkpoint_cli import command, environment

    launcher = subprocess.Popen(
        command(workdir, *SHORT), env=environment(),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    marker = workdir / "checkpoints" / str(after_step) / "commit_success.txt"
    deadline = time.monotonic() + 300
    while not marker.exists() and launcher.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert launcher.poll() is None, "the job ended before it could be stopped"
    children = _children(launcher)
    os.kill(children[1], sig)
    start = time.monotonic()
    output, _ = launcher.communicate(timeout=300)
    return launcher.returncode, output, time.monotonic() - start, children


def test_sigterm_to_one_of_two_processes_stops_both_at_one_step_and_resumes_bitwise(
    tmp_path, two_process_job
):
    """Ends bitwise as conftest's ``two_process_job``: the same command (SHORT), run to
    the end once for this test and test_cluster's."""
    from test_checkpoint_cli import assert_same_run, command, environment

    workdir = tmp_path / "run"
    status, output, _, _ = _start_and_signal_process_1(workdir, signal.SIGTERM, after_step=4)
    assert status == 0, output[-4000:]
    step = int(output.split("[0] stopped by SIGTERM after step ")[1].split(",")[0])
    saved = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    assert saved[-1] == step  # both processes saved the step they agreed on
    again = subprocess.run(
        command(workdir, *SHORT), env=environment(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert again.returncode == 0, again.stdout[-4000:]
    assert f"resuming from checkpoint step {step}" in again.stdout
    assert_same_run(workdir, two_process_job)


def test_sigkill_to_one_of_two_processes_ends_the_launch_naming_it(tmp_path):
    status, output, seconds, children = _start_and_signal_process_1(
        tmp_path / "run", signal.SIGKILL, after_step=4
    )
    assert status != 0
    assert "launcher: process 1 of 2 was killed by SIGKILL; stopping the others" in output
    assert seconds < 60
    assert not any(_alive(pid) for pid in children.values())


def test_processes_take_process_0s_layout_to_resume(tmp_path):
    """``auto.agreed_text``: what ``strategy="auto"`` resumes in is process 0's answer on
    every process, whatever each read (texts of any length, or none)."""
    script = tmp_path / "job.py"
    script.write_text(
        "from nnx_spmd_trainer import auto, distributed\n"
        "assert distributed.initialize()\n"
        "import jax\n"
        "i = jax.process_index()\n"
        "print('agreed:', auto.agreed_text(f'FSDP({i})'), flush=True)\n"
        "print('none:', auto.agreed_text(None if i == 0 else 'FSDP()'), flush=True)\n"
        "print('longer:', auto.agreed_text('ab' if i == 0 else 'a longer text'), flush=True)\n"
    )
    log = io.StringIO()
    status = distributed.Launch([sys.executable, str(script)], 2, out=log).run()
    assert status == 0, log.getvalue()[-4000:]
    for process in (0, 1):
        for line in ("agreed: FSDP(0)", "none: None", "longer: ab"):
            assert f"[{process}] {line}" in log.getvalue(), log.getvalue()[-2000:]
