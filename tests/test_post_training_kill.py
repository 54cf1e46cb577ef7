"""``--config=grpo`` and ``--config=dpo`` killed with SIGKILL after their first
checkpoint, then run again: the same rewards (GRPO) or losses (DPO) at every log point and
bitwise the same final weights as a run that was never stopped (GRPO's sampler keys are a
function of the seed and the step; DPO's batches of the seed and the batch's index). GRPO
samples at temperature 0.7 and top-p 0.9, the loss scoring that distribution."""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import environment_for_own_devices

pytestmark = [pytest.mark.serial, pytest.mark.slow]

REWARD = '''
def share_of_e(prompts, completions, word):
    """The share of a completion's characters that are 'e': it depends on the sample."""
    return [c.count("e") / max(1, len(c)) for c in completions]
'''
WORDS = ["red", "blue", "green", "gold", "pink", "gray", "teal", "navy"]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("grpo-kill")
    rows = [{"prompt": f"say {w}:", "word": w} for w in WORDS * 2]
    (folder / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "kill_rewards.py").write_text(REWARD)
    pairs = [{"prompt": f"say {w}:", "chosen": f" {w}", "rejected": " no"} for w in WORDS * 2]
    (folder / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
    return folder


#: The default job's GPT (the dpo and grpo configs' model) at small sizes.
SMALL = [
    "--config.gpt.seq_len=32", "--config.gpt.embed_dim=32", "--config.gpt.num_heads=4",
    "--config.gpt.ff_dim=64", "--config.gpt.num_layers=1", "--config.data.vocab_size=300",
]  # fmt: skip


def grpo_command(files: Path, workdir: Path) -> list[str]:
    return [
        sys.executable, "-m", "nnx_spmd_trainer", "--config=grpo", f"--workdir={workdir}",
        *SMALL,
        f"--export={workdir}-export",
        f"--config.data.prompts={files / 'prompts.jsonl'}",
        "--config.grpo.reward=kill_rewards:share_of_e",
        # The sampled distribution (tempered, top-p truncated) is the one trained on.
        "--config.grpo.temperature=0.7", "--config.grpo.top_p=0.9",
        "--config.max_steps=8", "--config.checkpoint_every_n_steps=2",
        "--config.log_every_n_steps=2", "--config.loggers=csv",
    ]  # fmt: skip


def dpo_command(files: Path, workdir: Path) -> list[str]:
    return [
        sys.executable, "-m", "nnx_spmd_trainer", "--config=dpo", f"--workdir={workdir}",
        *SMALL,
        f"--export={workdir}-export",
        f"--config.data.preferences={files / 'pairs.jsonl'}",
        "--config.max_steps=8", "--config.checkpoint_every_n_steps=2",
        "--config.log_every_n_steps=1", "--config.loggers=csv",
    ]  # fmt: skip


def environment(files: Path) -> dict[str, str]:
    return {**environment_for_own_devices(), "PYTHONPATH": str(files)}


def run_to_the_end(command: list[str], files: Path) -> str:
    proc = subprocess.run(
        command, env=environment(files), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def logged(workdir: Path, key: str) -> list[tuple[int, str]]:
    """Every row of ``key`` in file order, as written: a row the killed run logged past its
    checkpoint would show up twice."""
    with (workdir / "metrics.csv").open(newline="") as f:
        return [(int(r["step"]), r[key]) for r in csv.DictReader(f) if r.get(key)]


def exported(workdir: Path) -> list[np.ndarray]:
    import jax

    return jax.tree.leaves(ocp.PyTreeCheckpointer().restore(Path(f"{workdir}-export").absolute()))


@pytest.mark.parametrize(
    ("make_command", "key", "rows"),
    [(grpo_command, "train/reward", 4), (dpo_command, "train/loss", 8)],
    ids=["grpo", "dpo"],
)
def test_sigkill_then_the_same_command_gives_the_same_metrics_and_weights(
    files, tmp_path, make_command, key, rows
):
    whole = tmp_path / "whole"
    run_to_the_end(make_command(files, whole), files)
    workdir = tmp_path / "killed"
    proc = subprocess.Popen(
        make_command(files, workdir), env=environment(files), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    marker = workdir / "checkpoints" / "2" / "commit_success.txt"
    deadline = time.monotonic() + 240
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert not (workdir / "checkpoints" / "8").exists()
    out = run_to_the_end(make_command(files, workdir), files)
    assert "resuming from checkpoint step" in out
    assert "final after 8 steps" in out
    want = logged(whole, key)
    assert len(want) == rows and len({value for _, value in want}) > 1  # values that vary
    assert logged(workdir, key) == want
    ours, theirs = exported(workdir), exported(whole)
    assert len(ours) == len(theirs)
    for got, expected in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(got, expected)
