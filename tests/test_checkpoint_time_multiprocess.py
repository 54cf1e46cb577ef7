"""Two processes saving checkpoints by the clock save the same steps: process 0's clock
decides, at log points, and the other processes follow (distributed.agree)."""

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
