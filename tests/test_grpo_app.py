"""``--config=grpo`` (and ``--config=dpo``) through the app: the dry run prints each phase's
peak per device from the compiler (learning step, reference pass, prefill and decode with
the cache), a rollout that cannot fit beside the policy under a small budget is refused in
one line with the numbers, completions end at a stop string, and a reward that raises or
answers NaN mid-run ends the run in one line with no step taken on it."""

from __future__ import annotations

import csv
import importlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import environment_for_own_devices

from nnx_spmd_trainer.app import post_training_job, tasks

REWARDS = '''
import math
CALLS = {"raises": 0, "nan": 0}


def length(prompts, completions, score):
    return [float(len(c)) for c in completions]


def raises_third(prompts, completions, score):
    """Fine at the start-up check and the first rollout; the grader crashes at the second."""
    CALLS["raises"] += 1
    if CALLS["raises"] >= 3:
        raise ValueError("the grader crashed\\nwith a second line")
    return [float(len(c)) for c in completions]


def nan_third(prompts, completions, score):
    CALLS["nan"] += 1
    return [math.nan if CALLS["nan"] >= 3 else 1.0 for c in completions]
'''
WORDS = ["red", "blue", "green", "gold", "pink", "gray", "teal", "navy"]
SMALL = dict(seq_len=32, embed_dim=32, num_heads=4, ff_dim=64, num_layers=1)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("grpo-app")
    rows = [{"prompt": f"say {w}:", "score": i} for i, w in enumerate(WORDS * 2)]
    (folder / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pairs = [{"prompt": f"say {w}:", "chosen": f" {w}", "rejected": " no"} for w in WORDS * 2]
    (folder / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
    (folder / "grpo_app_rewards.py").write_text(REWARDS)
    return folder


@pytest.fixture(autouse=True)
def rewards_importable(files, monkeypatch):
    monkeypatch.syspath_prepend(str(files))


def config_of(name: str, files: Path, **keys):
    config = importlib.import_module(f"nnx_spmd_trainer.configs.{name}").get_config()
    config.update(**keys)
    config.gpt.update(**SMALL)
    config.data.vocab_size = 300
    if name == "grpo":
        config.data.prompts = str(files / "prompts.jsonl")
        config.grpo.update(reward="grpo_app_rewards:length", max_new_tokens=6)
    else:
        config.data.preferences = str(files / "pairs.jsonl")
    return config


def grpo_config(files: Path, **grpo):
    config = config_of("grpo", files, max_steps=4, log_every_n_steps=2, checkpoint_every_n_steps=2)
    config.grpo.update(**grpo)
    return config


def test_the_dry_runs_print_each_phases_peak_per_device(files, tmp_path, capsys):
    config = grpo_config(files, beta=0.1, temperature=0.7, top_p=0.9)
    post_training_job.run(config, tmp_path / "grpo", dry_run=True)
    out = capsys.readouterr().out
    print(out)
    assert "memory per device of each phase (the compiler's analysis):" in out
    # No stop strings: the sampler runs prefill and the decode loop as one program.
    for phase in ("learning step", "reference pass", "rollout (prefill and decode)"):
        assert f"  {phase}: peak " in out, phase
    assert ", cache " in out and "rows x" in out  # the cache's bytes beside the rollout
    # With them, two programs (the host checks the strings between blocks of steps).
    post_training_job.run(grpo_config(files, stop=(" ",)), tmp_path / "grpo", dry_run=True)
    out = capsys.readouterr().out
    assert "  rollout prefill: peak " in out and "  rollout decode: peak " in out
    post_training_job.run(config_of("dpo", files, max_steps=2), tmp_path / "dpo", dry_run=True)
    out = capsys.readouterr().out
    assert "  learning step: peak " in out and "  reference pass: peak " in out
    assert not (tmp_path / "grpo").exists() and not (tmp_path / "dpo").exists()


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu")
def test_the_dry_runs_plan_each_phase_for_tpu_chips_that_are_not_here(files, tmp_path, capsys):
    """Issue 55: --config=grpo|dpo --dry_run --config.target=v5e:2x2 plans the step and
    every phase (the reference pass, the rollout: the sampler's program) for the chips."""
    from nnx_spmd_trainer.app import target_plan

    config = grpo_config(files, beta=0.1, temperature=0.7, top_p=0.9)
    config.target = "v5e:2x2"
    assert target_plan.dry_run(config, dry_run=True) == 0
    out = capsys.readouterr().out
    assert "planning for v5e:2x2: 4 v5e chips (not here)" in out and "(TPU v5 lite)" in out
    for phase in ("learning step", "reference pass", "rollout (prefill and decode)"):
        assert f"  {phase}: peak " in out, phase
    dpo = config_of("dpo", files, max_steps=2)
    dpo.target = "v5e:2x2"
    assert target_plan.dry_run(dpo, dry_run=True) == 0
    out = capsys.readouterr().out
    assert "  learning step: peak " in out and "  reference pass: peak " in out
    assert "(TPU v5 lite)" in out and not list(tmp_path.iterdir())


def test_a_rollout_that_cannot_fit_beside_the_policy_is_refused_in_one_line(files, tmp_path):
    config = grpo_config(files)
    config.memory_budget_bytes = 200_000
    with pytest.raises(tasks.ConfigError) as caught:
        post_training_job.run(config, tmp_path / "run")
    message = str(caught.value)
    print(message)
    assert "\n" not in message
    assert message.startswith("config.memory_budget_bytes=200000: the GRPO rollout ")
    assert "bytes a device" in message and "more than the budget of 200,000" in message
    assert not (tmp_path / "run").exists()


def logged(workdir: Path, key: str) -> list[float]:
    with (workdir / "metrics.csv").open(newline="") as f:
        return [float(r[key]) for r in csv.DictReader(f) if r.get(key)]


def test_completions_end_at_a_stop_string_before_the_limit(files, tmp_path):
    config = grpo_config(files, stop=(" ",), temperature=1.0)
    config.loggers = "csv"
    post_training_job.run(config, tmp_path / "run")
    lengths = logged(tmp_path / "run", "train/completion_length")
    print("mean completion length by log point:", lengths)
    assert lengths and min(lengths) < 6  # 6: config.grpo.max_new_tokens


def saved_steps(workdir: Path) -> list[int]:
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def test_a_reward_that_answers_nan_mid_run_ends_in_one_line_with_no_step_on_it(files, tmp_path):
    config = grpo_config(files, reward="grpo_app_rewards:nan_third")
    with pytest.raises(tasks.ConfigError) as caught:
        post_training_job.run(config, tmp_path / "run")
    message = str(caught.value)
    assert "\n" not in message and "config.grpo.reward='grpo_app_rewards:nan_third'" in message
    assert "non-finite reward (nan for completion 0)" in message
    assert saved_steps(tmp_path / "run") == [2]  # the first rollout's; none after
    state = ocp.StandardCheckpointer().restore(tmp_path / "run" / "checkpoints" / "2" / "state")
    leaves = [
        np.asarray(x)
        for x in jax.tree.leaves(state["model"])
        if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
    ]
    assert leaves and all(np.isfinite(x).all() for x in leaves if x.dtype.kind == "f")


@pytest.mark.serial
def test_a_reward_that_raises_mid_run_exits_non_zero_with_one_line(files, tmp_path):
    workdir = tmp_path / "run"
    sizes = [f"--config.gpt.{k}={v}" for k, v in SMALL.items()]
    proc = subprocess.run(
        [
            sys.executable, "-m", "nnx_spmd_trainer", "--config=grpo", f"--workdir={workdir}",
            f"--config.data.prompts={files / 'prompts.jsonl'}",
            "--config.grpo.reward=grpo_app_rewards:raises_third", "--config.data.vocab_size=300",
            "--config.grpo.max_new_tokens=6", "--config.max_steps=4",
            "--config.checkpoint_every_n_steps=2", *sizes,
        ],
        env={**environment_for_own_devices(), "PYTHONPATH": str(files)},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(
        "nnx-spmd-train: error: config.grpo.reward='grpo_app_rewards:raises_third': reward "
        "function raises_third raised ValueError: the grader crashed on "
    ), line
    assert saved_steps(workdir) == [2]
