"""Eight simulated CPU devices for every test, set once before JAX starts its backend.

The CPU is the platform of every test process and of the commands they start,
whatever accelerator the machine has: a GPU would otherwise become the
default backend, with one device where the tests expect eight. The GPU tests
(``test_gpu.py``) start their own processes on the GPU.
"""

import atexit
import os
import shutil
import subprocess
import tempfile

import pytest

# The test programs are tiny: LLVM's optimizations of XLA's CPU code cost more compile time
# than they save in run time (a test file's time falls by a third to a half at level 0).
# Numerics stay IEEE float32; every comparison in the tests is between computations
# compiled alike or within a tolerance. Benchmarks started by tests inherit it: their
# tables are checked, never their speed.
FAST_COMPILE = "--xla_backend_optimization_level=0"
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {FAST_COMPILE}")
os.environ["JAX_PLATFORMS"] = "cpu"

# One persistent compilation cache for the session and every process it starts (CLI
# runs, multi-process workers): the same small programs compile once, not once per
# process. Entries are keyed by the program, the compile options and XLA_FLAGS, so none
# is ever served for another program; the directory goes with the session.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="nnx-spmd-tests-jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# Trainers defer to that JAX setting (planner/compile_cache.py, rule 3), even where a shell
# exports a cache directory for the library: tests never write the user's default cache.
os.environ["NNX_SPMD_TRAINER_COMPILE_CACHE"] = "auto"


def environment_for_own_devices() -> dict[str, str]:
    """``os.environ`` for a process that simulates its own devices (the CLI sets a count
    from its config; without one, a plain process has one CPU device): ``XLA_FLAGS``
    keeps the tests' compile flags, not their device count."""
    return {**os.environ, "XLA_FLAGS": FAST_COMPILE}


@pytest.fixture(scope="session")
def two_process_job(tmp_path_factory):
    """test_checkpoint_cli's small job for 12 steps as 2 processes (4 devices each), run to
    the end once: the uninterrupted run that test_cluster's SLURM tasks and
    test_multiprocess's launched processes, stopped and resumed, must end bitwise as.
    The workdir (its metrics.csv and ``<workdir>-export``) is only read."""
    from test_checkpoint_cli import command, environment

    workdir = tmp_path_factory.mktemp("two-process-job") / "run"
    proc = subprocess.run(
        command(workdir, "--num_processes=2", "--config.max_steps=12"),
        env=environment(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert "[0] final after 12 steps" in proc.stdout, proc.stdout[-3000:]
    return workdir
