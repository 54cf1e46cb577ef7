"""``nnx-spmd-train --config.strategy=...`` with the sequence split: the default job, and
a sequence length the ``seq`` axis does not divide."""

import subprocess
import sys

import pytest
from conftest import environment_for_own_devices

TINY_GPT = (
    "--config.max_steps=2",
    "--config.batch_size=16",
    "--config.max_eval_batches=1",
    "--config.log_every_n_steps=1",
    "--config.gpt.embed_dim=32",
    "--config.gpt.ff_dim=64",
    "--config.gpt.num_layers=1",
)


def cli(*args, cwd):
    env = environment_for_own_devices()  # the CLI sets 8 devices
    return subprocess.run(
        [sys.executable, "-m", "nnx_spmd_trainer", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("spec", "attention", "mesh"),
    [
        (
            "fsdp=2,seq=4",
            "all_gather",
            "{'fsdp': 2, 'seq': 4} (Hybrid(FSDP(2), SequenceParallel(4))",
        ),
        # the ring form (issue 31) in the same two runs: seq=8 takes it
        ("seq=8", "ring", "{'seq': 8} (SequenceParallel(8, attention='ring')"),
    ],
    ids=["fsdp2-seq4", "seq8-ring"],
)
def test_the_default_job_runs_with_the_sequence_split(tmp_path, spec, attention, mesh):
    proc = cli(
        f"--config.strategy={spec}", f"--config.sequence_attention={attention}",
        "--config.gpt.seq_len=16", *TINY_GPT, "--workdir=out", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"mesh {mesh}" in proc.stdout
    assert "final after 2 steps: eval loss" in proc.stdout
    assert list((tmp_path / "out" / "checkpoints").glob("2*"))  # the final step saved


def test_a_sequence_the_seq_axis_does_not_divide_blames_the_sequence_length(tmp_path):
    proc = cli(
        "--config.strategy=fsdp=2,seq=4", "--config.gpt.seq_len=6", *TINY_GPT, "--workdir=out",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2  # a configuration error
    (line,) = proc.stderr.strip().splitlines()[-1:]
    assert line.startswith(
        "nnx-spmd-train: error: config.strategy='fsdp=2,seq=4' with config.gpt.seq_len=6: "
        "SequenceParallel(4): batch leaf ['inputs'] has shape (16, 6)"
    ), line
    assert "Use a sequence length divisible by 4" in line
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()  # nothing written
