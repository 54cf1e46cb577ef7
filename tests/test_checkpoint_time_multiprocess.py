"""Two processes saving checkpoints by the clock save the same steps: process 0's clock
decides, at log points, and the other processes follow (distributed.agree). Two processes
saving in two tiers resume from the newest step of either, as one run would."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from nnx_spmd_trainer import distributed
from nnx_spmd_trainer.callbacks import OrbaxCheckpoint

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # make test runs these alone
WORKER = Path(__file__).parent / "mp_checkpoint_time_worker.py"
TIERS_WORKER = Path(__file__).parent / "mp_checkpoint_tiers_worker.py"


def test_two_processes_save_by_process_0s_clock_at_the_same_steps(tmp_path):
    checkpoints, log = tmp_path / "ckpt", io.StringIO()
    status = distributed.Launch([sys.executable, str(WORKER), str(checkpoints)], 2, out=log).run()
    assert status == 0, log.getvalue()[-4000:]
    saved = [json.loads(Path(f"{checkpoints}.saved.{p}").read_text()) for p in (0, 1)]
    # Step 2 ends the first fit; 2.4 s after step 5 make step 6 (the next log point) due
    # by process 0's clock; 10 ends the second fit. Process 1's own clock (10^9 s) would
    # never have saved 6: it followed process 0.
    assert saved[0] == saved[1] == [2, 6, 10]
    assert OrbaxCheckpoint(checkpoints).steps() == [2, 6, 10]


def test_two_processes_failing_after_step_7_resume_from_the_newer_local_tier_as_one_run(
    tmp_path,
):
    root, log = tmp_path / "tiers", io.StringIO()
    status = distributed.Launch([sys.executable, str(TIERS_WORKER), str(root)], 2, out=log).run()
    assert status == 0, log.getvalue()[-4000:]
    seen = [json.loads(Path(f"{root}.{p}.json").read_text()) for p in (0, 1)]
    for each in seen:
        assert each["left"] == {"persistent": [4], "local": [3, 6]}  # failed after step 7
        assert each["restored"] == 6  # local 6, newer than persistent 4
        assert each["after"] == each["whole"][6:]  # bitwise, steps 7 to 10
        assert each["persistent"] == [4, 8, 10] and each["local"] == [3, 6, 9]
    assert seen[0]["after"] == seen[1]["after"]
