"""DPO from a LoRA run of the default GPT (``--config.init_from=<its workdir>``): its
adapters merged into the base first (``config.lora.init_from_adapters='merge'``, the
default), or trained on with the base as the reference (``'keep'``); and the merged
export of a model without a weight map, read back by ``--config.init_from``."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from test_post_training_cli import (
    dpo_config,
    files,
    grpo_config,
    named_arrays,
    saved_params,
    sft_config,
)

from nnx_spmd_trainer.app import job, job_export, post_training_job, tasks

__all__ = ["files"]  # the pairs' fixture, shared

RANK, ALPHA = 4, 8.0  # a scale of 2: a fold at scale 1 would not match


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    """A LoRA run of the default GPT, its adapters moved off their start (B = 0)."""
    workdir = tmp_path_factory.mktemp("lora") / "sft"
    config = sft_config(strategy="fsdp=-1", learning_rate=0.05)
    config.lora.update(rank=RANK, alpha=ALPHA)
    result = job.run(config, workdir)
    export = workdir.parent / "merged"
    job_export.export(result.trainer, export, "merged", workdir=workdir)
    return workdir


def folded_by_hand(step_dir: Path) -> dict[str, np.ndarray]:
    """The step's base with ``W + alpha / rank * A B`` at each adapted kernel (NumPy,
    float64), from the arrays Orbax alone reads."""
    saved = saved_params(step_dir)
    out = {}
    for name, value in saved.items():
        if name.endswith(("lora_a", "lora_b")):
            continue
        layer = name.removesuffix("/kernel")
        if name.endswith("/kernel") and f"{layer}/lora_a" in saved:
            a = saved[f"{layer}/lora_a"].astype(np.float64)
            b = saved[f"{layer}/lora_b"].astype(np.float64)
            delta = np.tensordot(a, b, axes=1).reshape(value.shape)  # [in, r] . [r, heads, dim]
            value = value + ALPHA / RANK * delta
        out[name] = value
    return out


def newest_step(workdir: Path) -> Path:
    steps = [p for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()]
    return max(steps, key=lambda p: int(p.name))


def test_dpo_from_a_lora_run_merges_its_adapters_by_default(files, lora_run, tmp_path, capsys):
    from flax import nnx

    step = newest_step(lora_run)
    assert any(k.endswith("lora_b") and np.abs(v).max() > 0 for k, v in saved_params(step).items())
    config = dpo_config(files, max_steps=1, loggers="csv", init_from=str(lora_run))
    assert config.lora.init_from_adapters == "merge"  # the default
    result = post_training_job.run(config, tmp_path / "dpo")
    trainer = result.trainer
    assert trainer.plan.lora is None  # a plain model: the adapters are in its kernels
    ours = named_arrays(nnx.filter_state(trainer.initial_state()["model"], nnx.Param))
    want = folded_by_hand(step)
    assert ours.keys() == want.keys()
    for name, value in want.items():
        np.testing.assert_allclose(ours[name], value, rtol=2e-5, atol=2e-6, err_msg=name)
    # The reference is the start, the merged SFT model: h = 0 at step 0, the loss log 2.
    assert result.history.history["train/loss"][0] == pytest.approx(math.log(2.0), abs=1e-6)


def test_dpo_from_a_lora_run_can_keep_training_its_adapters(files, lora_run, tmp_path):
    from flax import nnx

    from nnx_spmd_trainer.post_training import base_is_reference

    config = dpo_config(files, max_steps=1, loggers="csv", init_from=str(lora_run))
    config.lora.init_from_adapters = "keep"
    result = post_training_job.run(config, tmp_path / "dpo")
    trainer = result.trainer
    lora = trainer.plan.lora
    assert (lora.rank, lora.scale) == (RANK, ALPHA / RANK)  # the LoRA run's, from its config
    assert base_is_reference(trainer)  # the reference: the base under the adapters
    ours = named_arrays(nnx.filter_state(trainer.initial_state()["model"], nnx.Param))
    theirs = saved_params(newest_step(lora_run))
    assert ours.keys() == theirs.keys()  # the adapters read, not drawn afresh
    for name, value in theirs.items():
        np.testing.assert_array_equal(ours[name], value, err_msg=name)
    # The policy (base + the SFT's adapters) is not its reference (the base): h != 0.
    assert abs(result.history.history["train/loss"][0] - math.log(2.0)) > 1e-6


def test_grpo_from_a_lora_run_checks_its_start_before_anything_is_written(
    files, lora_run, tmp_path, monkeypatch, capsys
):
    """GRPO reads a LoRA run as DPO does (the same start, ``lora_start``): a dry run reads
    and folds the step's parameters into the plan's layout and notes nothing that would
    refuse the run."""
    monkeypatch.syspath_prepend(str(files))  # the reward's module
    config = grpo_config(files)
    config.update(init_from=str(lora_run))
    post_training_job.run(config, tmp_path / "grpo", dry_run=True)
    out = capsys.readouterr().out
    assert "dry run: the grpo job's keys" in out and "would be refused" not in out
    assert "init_from: the model of" in out
    assert not (tmp_path / "grpo").exists()


def test_keep_with_other_lora_settings_is_refused_naming_the_keys(files, lora_run, tmp_path):
    config = dpo_config(files, max_steps=1, init_from=str(lora_run))
    config.lora.update(init_from_adapters="keep", rank=2)
    with pytest.raises(tasks.ConfigError, match=r"config\.lora\.rank=2 .*rank 4, alpha 8"):
        post_training_job.run(config, tmp_path / "dpo")
    assert not (tmp_path / "dpo").exists()
    config.lora.update(init_from_adapters="fold", rank=0)
    with pytest.raises(tasks.ConfigError, match=r"config\.lora\.init_from_adapters='fold'"):
        post_training_job.run(config, tmp_path / "dpo")


def test_the_merged_export_of_the_default_gpt_is_what_init_from_reads(lora_run, tmp_path):
    """``--export_format=merged`` on a model without a weight map: one safetensors file
    under the model's own paths (each kernel ``W + alpha / rank * A B``, the adapters
    gone) and the run's tokenizer; ``--config.init_from=<it>`` starts from exactly it."""
    import safetensors.numpy
    from flax import nnx

    export = lora_run.parent / "merged"
    assert sorted(p.name for p in export.iterdir()) == ["model.safetensors", "tokenizer.json"]
    file = safetensors.numpy.load_file(str(export / "model.safetensors"))
    want = folded_by_hand(newest_step(lora_run))
    assert file.keys() == want.keys()
    for name, value in want.items():
        np.testing.assert_allclose(file[name], value, rtol=2e-5, atol=2e-6, err_msg=name)
    config = sft_config(init_from=str(export))  # the export's tokenizer.json is read
    result = job.run(config, tmp_path / "again")  # the job's init_from path
    trainer = result.trainer
    saved = (tmp_path / "again" / "tokenizer.json").read_text()
    assert saved == (export / "tokenizer.json").read_text()
    ours = named_arrays(nnx.filter_state(trainer.initial_state()["model"], nnx.Param))
    assert ours.keys() == file.keys()
    for name, value in file.items():
        np.testing.assert_array_equal(ours[name], value, err_msg=name)
