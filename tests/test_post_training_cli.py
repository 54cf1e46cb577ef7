"""``--config=dpo`` and ``--config=grpo``: the jobs run through the CLI's job (in process),
log what their trainers log, and refuse bad input in one line with nothing written."""

from __future__ import annotations

import csv
import importlib
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import environment_for_own_devices
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from nnx_spmd_trainer.app import post_training_job, tasks
from nnx_spmd_trainer.post_training import prompt_batches

WORDS = ["red", "blue", "green", "gold", "pink", "gray", "teal", "navy"]
REWARDS = '''
def row_score(prompts, completions, score):
    """The row's own score, whatever was sampled: the mean is known in advance."""
    return [float(s) for s in score]


def two_per(prompts, completions, score):
    return [[1.0, 2.0]] * len(completions)
'''


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def pair_rows(count: int = 16) -> list[dict]:
    return [
        {"prompt": f"say {WORDS[i % 8]}:", "chosen": f" {WORDS[i % 8]}", "rejected": " no"}
        for i in range(count)
    ]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("post-training")
    same = {"prompt": "x", "chosen": "same", "rejected": "same"}
    write_jsonl(folder / "pairs.jsonl", [*pair_rows(), same])
    write_jsonl(folder / "identical.jsonl", [same, same])
    write_jsonl(folder / "missing.jsonl", [*pair_rows(2), {"prompt": "p", "chosen": "c"}])
    chat = [
        {
            "prompt": [{"role": "user", "content": row["prompt"]}],
            "chosen": [{"role": "assistant", "content": row["chosen"]}],
            "rejected": [{"role": "assistant", "content": row["rejected"]}],
        }
        for row in pair_rows(8)
    ]
    write_jsonl(folder / "chat.jsonl", chat)
    prompts = [{"prompt": f"say {w}:", "score": i} for i, w in enumerate(WORDS * 2)]
    write_jsonl(folder / "prompts.jsonl", prompts)
    (folder / "pt_cli_rewards.py").write_text(REWARDS)
    return folder


@pytest.fixture(autouse=True)
def rewards_importable(files, monkeypatch):
    monkeypatch.syspath_prepend(str(files))


def config_of(name: str, **keys):
    """A config at small sizes: the dpo and grpo configs are the default job's GPT, so
    every run here (default, dpo, grpo) is shrunk alike and each reads the others'."""
    config = importlib.import_module(f"nnx_spmd_trainer.configs.{name}").get_config()
    config.update(log_every_n_steps=keys.pop("log_every_n_steps", 1), **keys)
    config.gpt.update(seq_len=32, embed_dim=32, num_heads=4, ff_dim=64, num_layers=1)
    config.data.vocab_size = 300
    return config


def dpo_config(files: Path, data: str = "pairs.jsonl", **keys):
    config = config_of("dpo", max_steps=keys.pop("max_steps", 3), **keys)
    config.data.preferences = str(files / data)
    return config


def grpo_config(files: Path, reward: str = "pt_cli_rewards:row_score", **grpo):
    config = config_of("grpo", max_steps=4, log_every_n_steps=2, checkpoint_every_n_steps=2)
    config.data.prompts = str(files / "prompts.jsonl")
    config.grpo.update(reward=reward, max_new_tokens=4, **grpo)
    return config


def metrics(workdir: Path, key: str) -> list[float]:
    with (workdir / "metrics.csv").open(newline="") as f:
        return [float(r[key]) for r in csv.DictReader(f) if r.get(key)]


# -- DPO --------------------------------------------------------------------------------------
def test_a_dpo_run_trains_on_the_pairs_logs_trls_metrics_and_resumes(files, tmp_path, capsys):
    config = dpo_config(files)
    config.dpo.label_smoothing = 0.1
    result = post_training_job.run(config, tmp_path / "run")
    out = capsys.readouterr().out
    assert "preference data: 16 pairs, 1 skipped (chosen identical to rejected)" in out
    assert "final after 3 steps: loss" in out
    logs = result.history.history
    # At the first step the policy is the reference: h = 0, and the loss is log 2 (label
    # smoothing or not).
    assert logs["train/loss"][0] == pytest.approx(math.log(2.0), rel=1e-6)
    for key in ("rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected"):
        assert len(logs[f"train/{key}"]) == 3
    assert metrics(tmp_path / "run", "train/loss") == pytest.approx(logs["train/loss"])
    assert (tmp_path / "run" / "checkpoints" / "3").is_dir()
    assert (tmp_path / "run" / "tb").is_dir() and (tmp_path / "run" / "tokenizer.json").exists()
    # TensorBoard's plan report is of the step as it runs: on the batch prepare_batch
    # made, with the reference's log-probabilities (a step_record's batch_shapes).
    assert "reference_chosen_logps" in str(result.trainer.last_step.batch_shapes)
    tensorboard = EventAccumulator(str(tmp_path / "run" / "tb"), size_guidance={"tensors": 0})
    tensorboard.Reload()
    (plan,) = tensorboard.Tensors("plan/text_summary")
    assert "per device" in plan.tensor_proto.string_val[0].decode()
    again = post_training_job.run(config, tmp_path / "run")  # the same command: resumes
    assert again.trainer is not None and again.trainer.last_step is None
    assert "nothing trained" in capsys.readouterr().out


def test_the_ipo_loss_is_the_one_trained(files, tmp_path):
    config = dpo_config(files, max_steps=1, loggers="csv")
    config.dpo.loss_type = "ipo"
    result = post_training_job.run(config, tmp_path / "run")
    # h = 0 at the first step: IPO's loss is (0 - 1 / (2 beta))^2 = 25 at beta 0.1.
    assert result.history.history["train/loss"] == [pytest.approx(25.0, rel=1e-6)]


def test_chat_rows_are_rendered_with_the_chat_template(files, tmp_path, capsys):
    pytest.importorskip("transformers")
    config = dpo_config(files, "chat.jsonl", max_steps=1, loggers="csv")
    config.gpt.seq_len = 64  # ChatML's markers, spelled in the BPE's bytes
    message = refused(config, tmp_path / "refused", "holds chat rows", "chat_template=chatml")
    assert message.startswith("config.data.chat_template=''")
    config.data.chat_template = "chatml"
    result = post_training_job.run(config, tmp_path / "run")
    assert "preference data: 8 pairs, 0 skipped" in capsys.readouterr().out
    assert result.history.history["train/loss"] == [pytest.approx(math.log(2.0), rel=1e-6)]


# -- GRPO -------------------------------------------------------------------------------------
def test_a_grpo_run_rewards_the_rows_it_drew_and_its_ratio_starts_at_one(files, tmp_path):
    result = post_training_job.run(grpo_config(files), tmp_path / "run")
    logs = result.history.history
    # Each log point is one rollout of 8 prompts drawn by prompt_batches(seed 0); the
    # reward is each row's own score, so the logged mean is known without sampling.
    want = [float(np.mean(b["row"])) for b in prompt_batches(16, 8, 2, seed=0)]
    assert logs["train/reward"] == pytest.approx(want, abs=1e-6)
    assert metrics(tmp_path / "run", "train/reward") == pytest.approx(want, abs=1e-6)
    assert logs["train/ratio_deviation"] == [0.0, 0.0]
    assert (tmp_path / "run" / "checkpoints" / "4").is_dir()


# -- bad input: one line, nothing written -----------------------------------------------------
def refused(config, workdir: Path, *parts: str) -> str:
    with pytest.raises(tasks.ConfigError) as caught:
        post_training_job.run(config, workdir)
    message = str(caught.value)
    assert "\n" not in message
    for part in parts:
        assert part in message, message
    assert not workdir.exists()
    return message


def test_a_preference_row_without_rejected_is_refused_naming_file_and_line(files, tmp_path):
    refused(
        dpo_config(files, "missing.jsonl"), tmp_path / "run",
        f"{files / 'missing.jsonl'}:3", "'rejected'",
    )  # fmt: skip


def test_rows_all_identical_are_refused(files, tmp_path):
    refused(dpo_config(files, "identical.jsonl"), tmp_path / "run", "no usable preference pair")


def test_a_reward_that_cannot_be_imported_is_refused_naming_it(files, tmp_path):
    refused(
        grpo_config(files, "no_such_reward_module:f"), tmp_path / "run",
        "config.grpo.reward='no_such_reward_module:f'", "cannot be imported",
    )  # fmt: skip


def test_a_reward_of_the_wrong_shape_is_refused_saying_expected_and_got(files, tmp_path):
    refused(
        grpo_config(files, "pt_cli_rewards:two_per"), tmp_path / "run",
        "returned list of shape (4, 2)", "expected a sequence of 4 finite floats",
    )  # fmt: skip


def test_a_group_of_one_is_refused(files, tmp_path):
    refused(grpo_config(files, group_size=1), tmp_path / "run", "config.grpo.group_size=1")


def test_max_steps_must_be_whole_rollouts(files, tmp_path):
    config = grpo_config(files)
    config.max_steps = 3
    refused(config, tmp_path / "run", "config.max_steps=3", "multiple of 2")


@pytest.mark.serial
def test_the_command_line_exits_2_with_one_line(files, tmp_path):
    workdir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable, "-m", "nnx_spmd_trainer", "--config=dpo", f"--workdir={workdir}",
            f"--config.data.preferences={files / 'missing.jsonl'}",
        ],
        env=environment_for_own_devices(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("nnx-spmd-train: error: config.data.preferences=")
    assert "missing.jsonl:3: the preference row has no 'rejected'" in line
    assert not workdir.exists()


def test_a_dpo_loss_setting_is_refused_naming_its_key(files, tmp_path):
    config = dpo_config(files)
    config.dpo.loss_type = "hinge"
    refused(config, tmp_path / "run", "config.dpo.loss_type='hinge'", "'sigmoid', 'ipo'")


def test_a_dry_run_prints_the_plan_and_writes_nothing(files, tmp_path, capsys):
    config = dpo_config(files)
    config.lora.update(rank=4, targets=".*mha/(query|value)")
    post_training_job.run(config, tmp_path / "run", dry_run=True)
    out = capsys.readouterr().out
    assert "dry run: the dpo job's keys, data and layout checked" in out
    # The plan of the step as it runs (on the pairs with the reference's log-probabilities),
    # with what trains, what is frozen and the optimizer's bytes, as the plain job's.
    assert "plan: Hybrid(FSDP(4), TensorParallel(2)) on mesh {'fsdp': 4, 'model': 2}" in out
    assert "compiled step per device:" in out
    assert "  trainable: " in out and "; frozen: " in out
    assert "  optimizer per device: " in out
    assert not (tmp_path / "run").exists()


def test_a_grpo_dry_run_prints_the_plan_of_its_rollout_step(files, tmp_path, capsys):
    post_training_job.run(grpo_config(files, beta=0.1), tmp_path / "run", dry_run=True)
    out = capsys.readouterr().out
    assert "plan: DataParallel(8) on mesh {'data': 8}" in out
    assert "state per device: parameters" in out and "compiled step per device:" in out
    assert "dry run: the grpo job's keys, data and layout checked" in out
    assert not (tmp_path / "run").exists()


# -- from an earlier run of this library: config.init_from=<its workdir> ---------------------
def sft_config(**keys):
    """The default job's GPT at the sizes of configs/dpo.py, trained a few steps."""
    config = config_of("default", max_steps=2, batch_size=8, eval_every_n_steps=0,
                       max_eval_batches=1, warmup_steps=0, loggers="csv", **keys)  # fmt: skip
    config.gpt.update(seq_len=32, embed_dim=32, num_heads=4, ff_dim=64, num_layers=1)
    config.data.vocab_size = 300
    return config


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory) -> Path:
    """An SFT run of the default GPT on fsdp=-1 (fsdp=8): the DPO runs start on another layout."""
    from nnx_spmd_trainer.app import job

    workdir = tmp_path_factory.mktemp("sft") / "sft"
    job.run(sft_config(strategy="fsdp=-1"), workdir)
    return workdir


def saved_params(step_dir: Path) -> dict[str, np.ndarray]:
    """The model parameters of a step, read with Orbax alone (no trainer, no layout)."""
    import orbax.checkpoint as ocp

    state = ocp.StandardCheckpointer().restore(step_dir / "state")
    return named_arrays(state["model"], leave_out="rngs")


def named_arrays(tree, leave_out: str = "") -> dict[str, np.ndarray]:
    import jax

    from nnx_spmd_trainer import path_str

    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    named = {path_str(p): x for p, x in leaves}
    return {k: np.asarray(x) for k, x in named.items() if not leave_out or leave_out not in k}


def test_dpo_from_an_sft_workdir_starts_from_its_weights_on_another_layout(
    files, sft_run, tmp_path, capsys
):
    from flax import nnx

    config = dpo_config(files, max_steps=1, loggers="csv", init_from=str(sft_run))
    result = post_training_job.run(config, tmp_path / "dpo")
    assert "the optimizer starts fresh" in capsys.readouterr().out
    # The policy is the reference at step 0: h = 0, the loss log 2.
    assert result.history.history["train/loss"][0] == pytest.approx(math.log(2.0), abs=1e-6)
    trainer = result.trainer
    assert dict(trainer.mesh.shape) == {"fsdp": 4, "model": 2}  # the SFT run's was fsdp=8
    first = nnx.filter_state(trainer.initial_state()["model"], nnx.Param)
    ours = named_arrays(first)
    theirs = saved_params(sft_run / "checkpoints" / "2")
    assert ours.keys() == theirs.keys() and ours
    for name, value in theirs.items():
        np.testing.assert_array_equal(ours[name], value, err_msg=name)
    assert int(trainer.initial_state()["optimizer"]["step"][...]) == 0


def test_a_workdir_of_another_model_is_refused_naming_the_parameter(files, sft_run, tmp_path):
    config = dpo_config(files, init_from=str(sft_run))
    config.gpt.update(embed_dim=64, ff_dim=128)
    message = refused(config, tmp_path / "run", f"config.init_from={str(sft_run)!r}")
    assert "holds model parameter blocks/0/layer_norm1/bias of shape (32,)" in message
    assert "this model's is (64,)" in message


def test_a_directory_without_a_finished_step_is_refused(files, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    refused(
        dpo_config(files, init_from=str(empty)), tmp_path / "run",
        f"config.init_from={str(empty)!r}", "holds no finished checkpoint step",
    )  # fmt: skip


def test_lora_adapters_start_fresh_over_the_sft_weights(sft_run, tmp_path):
    """``Trainer(lora=..., init_from=CheckpointWeights(workdir))``: the base is the SFT
    step's model, the adapters are LoRA's own start (B = 0: the model is the SFT's). A step
    holding adapters is refused as a start (its base alone is not its run's model)."""
    import optax
    from flax import nnx

    from nnx_spmd_trainer import Trainer, callbacks
    from nnx_spmd_trainer.nn.lora import LoRA

    config = sft_config()
    config.data.tokenizer = str(sft_run / "tokenizer.json")
    task = tasks.build_task(config)
    saved = callbacks.OrbaxCheckpoint(tmp_path / "adapted", async_save=False)
    trainer = Trainer(
        task.model, optax.sgd(0.1), loss_fn=task.loss_fn, callbacks=[saved],
        strategy=tasks.parse_strategy("fsdp=2,model=4"),
        lora=LoRA(rank=4, targets=".*mha/(query|value)"),
        init_from=callbacks.CheckpointWeights(sft_run / "checkpoints"),
    )  # fmt: skip
    model = trainer.initial_state()["model"]
    base = named_arrays(nnx.filter_state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))))
    theirs = saved_params(sft_run / "checkpoints" / "2")
    assert base.keys() == theirs.keys()
    for name, value in theirs.items():
        np.testing.assert_array_equal(base[name], value, err_msg=name)
    adapters = named_arrays(nnx.filter_state(model, nnx.LoRAParam))
    assert sorted(adapters) == [
        f"blocks/0/mha/{layer}/lora_{ab}" for layer in ("query", "value") for ab in "ab"
    ]
    assert all(not value.any() for name, value in adapters.items() if name.endswith("lora_b"))
    saved.save(0)  # this LoRA run's step: its adapters and its base
    with pytest.raises(callbacks.CheckpointOfAnotherModel, match="holds LoRA adapters"):
        callbacks.CheckpointWeights(tmp_path / "adapted").check(trainer.plan)
