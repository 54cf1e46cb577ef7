"""The fine-tuning path at the command line: ``--config.lora.*``, ``--export_format=peft``
and ``--export_format=merged``."""

from __future__ import annotations

import pytest
from test_cli import _cli, load, shrink
from test_cli_config_errors import TINY, assert_refused

from nnx_spmd_trainer.app import job, tasks


@pytest.mark.parametrize("export_format", ["peft", "merged"])
def test_a_lora_export_without_lora_is_refused_in_one_line_with_nothing_written(
    tmp_path, export_format
):
    proc = _cli(
        *TINY,
        f"--export={tmp_path / 'out'}",
        f"--export_format={export_format}",
        f"--workdir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    assert_refused(proc, f"--export_format={export_format}: this run trains no LoRA adapters")
    assert "--config.lora.rank=8" in proc.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "out").exists()


def test_job_refuses_a_lora_export_of_a_run_without_adapters(tmp_path):
    config = shrink(load("gpt2_hf"))
    with pytest.raises(tasks.ConfigError, match=r"--export_format=peft: .*config\.lora\.rank=0"):
        job.run(config, tmp_path / "run", export_format="peft")
    assert not (tmp_path / "run").exists()
