"""The command line on a real cluster's bad days: several processes asked for a plan,
Ctrl-C in the middle of a save, a workdir gone read-only, a resume with another model.
Each is one line and an exit status, and the workdir is left as it was."""

from __future__ import annotations

import pytest
from test_cli import _cli

pytestmark = pytest.mark.slow

MLP = ["--config=mlp", "--config.max_steps=4", "--config.eval_every_n_steps=0"]


# -- item 2: a plan with several processes -----------------------------------------------------
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
