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
    assert {"Trainer.fit", "nnx.jit loop (seed documents)"} <= loops
    runs: dict[tuple[str, str], list[float]] = {}
    for row in results["step_time"]:
        if row["loop"].startswith("hand-written jax.jit"):
            runs.setdefault((row["workload"], row["strategy"]), []).append(row["vs_floor"])
    assert runs and all(len(hand) == 4 for hand in runs.values())  # four ways, each run
    # The floor is the fastest hand-written loop of its own run: a ratio of 1, none below.
    assert all(min(hand) == 1.0 for hand in runs.values())
    assert {row["strategy"] for row in results["memory"]} >= {"DataParallel", "FSDP"}
    table = (tmp_path / "results.md").read_text()
    assert "| workload | strategy | loop | ms_per_step | vs_floor |" in table


def test_gpu_benchmark_runs_at_tiny_sizes_anywhere(tmp_path):
    """``gpu.py --quick`` (the GPU measurements at tiny sizes, on this machine's CPU)."""
    script = Path(__file__).parent.parent / "benchmarks" / "gpu.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--quick", f"--out={tmp_path}"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "gpu.json").read_text())
    (gpt2,) = results["gpt2"]
    loops = {row["loop"]: row for row in gpt2["rows"]}
    limit = loops["hand-written GPT-2, bf16 + cuDNN attention (limit)"]
    assert limit["vs_limit"] == 1.0 and 0 < limit["mfu"] < 1
    assert {"Trainer.fit, shipped GPT bf16", "Trainer.fit, shipped GPT fp32"} <= set(loops)
    assert (
        "| loop | ms_per_step | tokens_per_s | mfu | vs_limit | vs_floor |"
        in (tmp_path / "gpu.md").read_text()
    )


def markdown_tables(text):
    """Each Markdown table of ``text`` (a run of ``|`` lines), as ``{header: cell}`` rows."""
    tables, block = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            block.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif block:
            header, _, *rows = block
            tables.append([dict(zip(header, row, strict=True)) for row in rows])
            block = []
    return tables


def test_memory_frontier_runs_at_tiny_sizes(tmp_path):
    """``memory_frontier.py --quick``: its three tables, with the effects it measures
    visible even at tiny sizes (remat and the chunked loss lower the temporaries)."""
    script = Path(__file__).parent.parent / "benchmarks" / "memory_frontier.py"
    out = tmp_path / "memory_frontier.md"
    proc = subprocess.run(
        [sys.executable, str(script), "--quick", f"--out={out}"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    policies, losses, frontier = markdown_tables(out.read_text())
    full = next(row for row in policies if row["policy"] == "full")
    assert float(full["per block / none"]) < 1
    assert float(losses[-1]["temporaries / device"]) < 1  # the ratio chunked / plain
    assert all(int(row["layers"]) >= 1 for row in frontier)


def test_minigpt_overhead_runs_at_tiny_sizes(tmp_path):
    """``minigpt_overhead.py --quick``: the miniGPT port's losses checked, every loop timed
    (wall and CPU), the JSON and the table written."""
    script = Path(__file__).parent.parent / "benchmarks" / "minigpt_overhead.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--quick", f"--out={tmp_path}"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "minigpt_overhead.json").read_text())
    assert result["loss_difference"] <= 1e-6
    rows = {row["loop"]: row for row in result["rows"]}
    assert {"tutorial nnx.jit loop", "Trainer.fit (defaults)"} <= set(rows)
    assert rows["tutorial nnx.jit loop"]["wall_vs_tutorial"] == 1.0
    assert all(row["cpu_ms_per_step"] > 0 for row in rows.values())
    assert (
        "| loop | wall ms/step | wall vs tutorial |"
        in (tmp_path / "minigpt_overhead.md").read_text()
    )


def test_generate_speed_runs_at_tiny_sizes(tmp_path):
    """``generate_speed.py --quick``: both batch sizes timed against the hand-written loop
    (the same tokens), the profile's time outside the programs read."""
    script = Path(__file__).parent.parent / "benchmarks" / "generate_speed.py"
    proc = subprocess.run(  # the tests' XLA_FLAGS: 8 devices
        [sys.executable, str(script), "--quick", f"--out={tmp_path}"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run,) = json.loads((tmp_path / "generate_speed_8dev.json").read_text())
    assert [row["batch"] for row in run["rows"]] == [1, 8]
    for row in run["rows"]:
        assert row["prefill_tokens_per_s"]["median"] > 0 < row["decode_tokens_per_s"]["median"]
        assert 0 <= row["host_share"]["median"] < 1 and 0 < row["program_share"] <= 1
        assert row["call_tokens_per_s"]["median"] > 0 < row["hand_tokens_per_s"]["median"]
        assert row["same_tokens"] == 1.0  # the library and the hand-written loop agree
    text = (tmp_path / "generate_speed.md").read_text()
    assert "| batch (rows) | library tokens/s (call) | hand-written tokens/s |" in text
