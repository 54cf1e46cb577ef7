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


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (  # a typo: the closest layer paths are named
            ("--config.lora.targets=blocks/0/mha/qery",),
            "LoRA(targets='blocks/0/mha/qery') matches no Linear, LinearGeneral or Einsum "
            "layer (0 other module(s)); the closest layer paths: blocks/0/mha/query",
        ),
        (("--config.lora.rank=1000",), "give a rank <= 32 or leave it out of targets"),
    ],
    ids=["targets-match-no-layer", "rank-above-the-dimensions"],
)
def test_bad_lora_settings_are_refused_in_one_line_with_nothing_written(tmp_path, flags, message):
    small = ("--config.gpt.embed_dim=32", "--config.gpt.num_heads=2", "--config.gpt.ff_dim=64")
    proc = _cli(
        "--config.lora.rank=2", *small, *flags, f"--workdir={tmp_path / 'run'}", cwd=tmp_path
    )
    assert_refused(proc, message)
    assert not (tmp_path / "run").exists()


def test_job_refuses_a_lora_export_of_a_run_without_adapters(tmp_path):
    config = shrink(load("gpt2_hf"))
    with pytest.raises(tasks.ConfigError, match=r"--export_format=peft: .*config\.lora\.rank=0"):
        job.run(config, tmp_path / "run", export_format="peft")
    assert not (tmp_path / "run").exists()


def test_export_writes_the_adapters_as_peft_and_the_merged_weights(tmp_path):
    import ml_collections
    import numpy as np
    import safetensors.numpy
    from test_finetune_checkpoints import CONFIG, batches, trainer_for
    from test_weights_gpt2 import hf_weights

    from nnx_spmd_trainer.app import job_export
    from nnx_spmd_trainer.app.models.gpt2_hf import gpt2_weight_map
    from nnx_spmd_trainer.weights import peft

    base = tmp_path / "base.safetensors"
    safetensors.numpy.save_file(hf_weights(CONFIG, seed=5), str(base))
    trainer = trainer_for(base)
    trainer.fit(batches(2), max_steps=2)  # the adapters move off their start (B = 0)
    lora = ml_collections.ConfigDict({"rank": 2, "alpha": 2.0, "dropout": 0.0})  # nnx.LoRA: 1
    weight_map = gpt2_weight_map(CONFIG)
    d = CONFIG.n_embd
    q = trainer.model.h[0].attn.q
    a, b = np.asarray(q.lora_a[...]), np.asarray(q.lora_b[...])
    assert np.abs(b).max() > 0

    out = job_export.export(trainer, tmp_path / "peft", "peft", weight_map=weight_map, lora=lora)
    adapter = peft.read_peft_adapter(out)
    assert adapter.config["fan_in_fan_out"] is True and adapter.config["r"] == 2
    module = "transformer.h.0.attn.c_attn"
    assert module in adapter.modules() and adapter.rank(module) == 4  # q and v fused
    lora_A, lora_B = adapter.pair(module)
    delta = (adapter.scaling(module) * lora_B @ lora_A).T
    np.testing.assert_allclose(delta[:, :d], a @ b, rtol=1e-5, atol=1e-6)

    merged = job_export.export(
        trainer, tmp_path / "merged", "merged", weight_map=weight_map, lora=lora
    )
    file = safetensors.numpy.load_file(str(merged))
    w = np.asarray(q.base_module.kernel[...])
    np.testing.assert_allclose(file["h.0.attn.c_attn.weight"][:, :d], w + a @ b, rtol=1e-6)
    np.testing.assert_array_equal(  # k has no adapter: the base's, bit for bit
        file["h.0.attn.c_attn.weight"][:, d : 2 * d],
        np.asarray(trainer.model.h[0].attn.k.kernel[...]),
    )


@pytest.mark.parametrize(
    ("name", "attention"),
    [("gpt2_hf", r".*attn/(q|k|v)"), ("default", r".*mha/(query|key|value)")],
)
def test_config_lora_makes_a_lora_run_never_a_whole_model_one(tmp_path, name, attention):
    """``--config.lora.rank`` reaches the Trainer as ``lora=LoRA(...)``; the default
    targets (``config.lora.targets=""``) are the attention's q, k and v in GPT-2's layer
    names and in the shipped GPT's."""
    import re

    from nnx_spmd_trainer.nn import lora

    config = shrink(load(name))
    config.update(max_steps=2)
    config.lora.rank = 2
    export = "peft" if name == "gpt2_hf" else "orbax"
    result = job.run(config, tmp_path / "run", export_format=export)
    adapted = sorted(lora.adapted_layers(result.trainer.model))
    assert len(adapted) == 3 and all(re.fullmatch(attention, path) for path in adapted), adapted
