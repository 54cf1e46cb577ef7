"""The benchmark command runs end to end (tiny sizes): its table is produced, not a speed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_run_all_writes_the_table_and_the_json(tmp_path):
    script = Path(__file__).parent.parent / "benchmarks" / "run_all.py"
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, str(script), "--quick", f"--out={tmp_path}"],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    loops = {row["loop"] for row in results["step_time"]}
    assert {"floor: hand-written jax.jit", "Trainer.fit", "nnx.jit loop (seed documents)"} <= loops
    floors = [r["vs_floor"] for r in results["step_time"] if r["loop"].startswith("floor")]
    assert floors and all(f == 1.0 for f in floors)  # each ratio is to its own run's floor
    assert {row["strategy"] for row in results["memory"]} >= {"DataParallel", "FSDP"}
    table = (tmp_path / "results.md").read_text()
    assert "| workload | strategy | loop | ms_per_step | vs_floor |" in table
