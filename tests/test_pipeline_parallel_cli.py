"""``nnx-spmd-train --config.strategy=data=2,stage=4``: the default job's scanned GPT
pipelined over 4 stages from the command line; without stacked layers, a one-line error."""

import pytest
from test_sequence_parallel_cli import TINY_GPT, cli

PIPELINED = (*TINY_GPT, "--config.gpt.num_layers=4", "--workdir=out")


@pytest.mark.slow
def test_the_default_job_runs_pipelined(tmp_path):
    proc = cli(
        "--config.strategy=data=2,stage=4", "--config.gpt.scan_layers=True", *PIPELINED,
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mesh {'data': 2, 'stage': 4}" in proc.stdout
    assert "final after 2 steps: eval loss" in proc.stdout
    assert list((tmp_path / "out" / "checkpoints").glob("2*"))  # the final step saved


def test_a_pipeline_without_stacked_layers_names_scan_layers(tmp_path):
    proc = cli("--config.strategy=data=2,stage=4", *PIPELINED, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()[-1:]
    assert line.startswith("nnx-spmd-train: error:")
    assert "--config.gpt.scan_layers=True" in line
    assert "Traceback" not in proc.stderr
