"""A post-training job from a config (``--config=dpo``, ``--config=grpo``): a
``DPOTrainer`` or ``GRPOTrainer`` built and checked before anything is written, as
``job.run`` builds a training job, then trained with the same callbacks (checkpoints,
TensorBoard, metrics.csv) and reported.

``config.post_training`` names the trainer. The model and the tokenizer are the GPT
task's (``config.model``: ``config.gpt`` and ``config.data.tokenizer`` in the shipped
configs; a ``gpt2_hf`` config of the user's with ``config.init_from`` starts from GPT-2's
weights, as any job); the data and the loss keys are ``post_training_data``'s.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path
from typing import Any

import jax
import ml_collections
import numpy as np

# callbacks/ is mapped onto nnx_spmd_trainer.callbacks at install time; mypy reads the tree.
from nnx_spmd_trainer import Trainer  # type: ignore[attr-defined]
from nnx_spmd_trainer.app import datasets, job, loader, start_from, tasks
from nnx_spmd_trainer.app import post_training_data as data
from nnx_spmd_trainer.app.console import say
from nnx_spmd_trainer.app.job_callbacks import make_callbacks
from nnx_spmd_trainer.app.job_checks import (
    blamed_on,
    check_checkpoints_are_of_this_model,
    check_first_batch,
    check_init_from,
    refused_or_noted,
)
from nnx_spmd_trainer.app.job_export import check_export_format
from nnx_spmd_trainer.app.job_lines import goodput_line, preempted_line
from nnx_spmd_trainer.app.workdir import (
    check_workdir_writable,
    workdir_lock,
)
from nnx_spmd_trainer.planner import compile_cache
from nnx_spmd_trainer.post_training import (
    DPOMetrics,
    DPOTrainer,
    GRPOMetrics,
    GRPOTrainer,
    ReferenceModel,
)

#: ``config.post_training``'s values: the trainers a config can name.
KINDS = ("dpo", "grpo")

#: The metrics the final line reports, by kind.
_FINAL_METRICS = {
    "dpo": ("train/loss", "train/rewards/accuracies", "train/rewards/margins"),
    "grpo": ("train/loss", "train/reward", "train/ratio_deviation"),
}


def kind(config: ml_collections.ConfigDict) -> str:
    """``config.post_training`` (``"dpo"``, ``"grpo"``), or ``""`` for a plain job."""
    return str(config.get("post_training", "") or "")


@dataclasses.dataclass(frozen=True)
class _Recipe:
    """What differs between the kinds: the trainer's class and keywords, the batches
    ``fit`` takes, the steps they last, and the data's line."""

    trainer_type: type[Trainer]
    keywords: dict[str, Any]
    batches: Any
    data_line: str


def run(
    config: ml_collections.ConfigDict,
    workdir: str | os.PathLike[str],
    *,
    dry_run: bool = False,
    export_format: str = "orbax",
) -> job.RunResult:
    """Trains with the post-training trainer ``config.post_training`` names: ``job.run``'s
    contract (a ``tasks.ConfigError`` naming the key, and nothing written, for a run that
    cannot be; ``dry_run`` checks and says so, writing nothing)."""
    tasks.check_config(config)
    name = kind(config)
    if name not in KINDS:
        raise tasks.ConfigError(
            f"config.post_training={name!r}: must be one of {', '.join(map(repr, KINDS))} "
            "(start from --config=dpo or --config=grpo)."
        )
    workdir = Path(workdir)
    notes: list[str] | None = [] if dry_run else None
    with refused_or_noted(notes, tasks.ConfigError):
        check_workdir_writable(workdir)
    # The trainer's keys first: a bad one is refused before the tokenizer is trained.
    keys = data.grpo_keys(config) if name == "grpo" else data.dpo_keys(config)
    layout = loader.layout_asked(config)
    with blamed_on(f"config.{config.model}"):
        task_config = start_from.tokenizer_config(config, workdir)
        task = tasks.build_task(task_config, shard=layout.shard)
    codec = task.splits.text_codec
    if codec is None:
        raise tasks.ConfigError(f"config.model={config.model!r}: post-training needs a text task.")
    recipe = (
        _dpo(config, codec, layout.shard, keys)
        if name == "dpo"
        else _grpo(config, codec, layout.shard, keys)
    )
    init_from = start_from.pretrained(config, task)
    check_export_format(config, task, export_format)
    with blamed_on("--workdir", OSError):
        run_callbacks = make_callbacks(config, workdir)
    splits = dataclasses.replace(task.splits, train=recipe.batches, eval=())
    trainer = job.build_trainer(
        config,
        dataclasses.replace(task, splits=splits),
        layout,
        run_callbacks,
        init_from,
        trainer_type=recipe.trainer_type,
        own=recipe.keywords,  # its loss and metrics, in place of the task's
    )
    batch = check_first_batch(config, layout.spec, trainer, splits)
    if config.resume:
        check_checkpoints_are_of_this_model(run_callbacks, notes)
    check_init_from(config, init_from, trainer, run_callbacks, notes)
    say(recipe.data_line)
    if notes is not None:
        first = batch if batch is not None else next(iter(splits.train))
        say(str(job.plan_report_of(trainer, step_batch_stand_in(trainer, first))))
        say(f"dry run: the {name} job's keys, data and layout checked; nothing trained or written")
        for note in notes:
            say(f"note: the run itself would be refused: {note}")
        return job.RunResult(trainer.history, float("nan"), float("nan"), "", None)
    with workdir_lock(workdir):
        history = _train(config, workdir, trainer, splits, name, layout.spec)
    return job.RunResult(
        history, float("nan"), float("nan"), "", trainer, weight_map=task.weight_map
    )


def step_batch_stand_in(trainer: Trainer, batch: dict[str, Any]) -> dict[str, np.ndarray]:
    """Zeros shaped as the batch the train step reads once ``prepare_batch`` has made it
    from ``batch`` (this process's rows): DPO's pairs with the reference's
    log-probabilities, GRPO's rollout of ``batch["row"]``'s prompts. What a dry run plans
    the step on, without running the reference or sampling a rollout."""
    if isinstance(trainer, DPOTrainer):
        rows = np.shape(batch["chosen_inputs"])[0]
        return {**batch, **{key: np.zeros(rows, np.float32) for key in ReferenceModel.KEYS}}
    if isinstance(trainer, GRPOTrainer):
        rows, seq = np.shape(batch["row"])[0] * trainer.group_size, trainer.seq_len
        tokens, floats = np.zeros((rows, seq), np.int32), np.zeros((rows, seq), np.float32)
        rollout = {"inputs": tokens, "targets": tokens, "weights": floats}
        rollout.update(rewards=floats[:, 0], advantages=floats[:, 0], sampler_logps=floats)
        if trainer.beta > 0:
            rollout["reference_logps"] = floats
        return rollout
    return batch


def _dpo(
    config: ml_collections.ConfigDict, codec: Any, shard: Any, keywords: dict[str, Any]
) -> _Recipe:
    """DPO's trainer keywords (``config.dpo``'s, checked) and batches of pairs."""
    keywords = {**keywords, "metrics": DPOMetrics}
    rows, pairs = data.preference_pairs(config, codec)
    batches = data.pair_batches(
        pairs,
        batch_size=config.batch_size,
        seq_len=data.model_positions(config)[1],
        steps=config.max_steps,
        seed=config.seed,
        shard=shard,
    )
    return _Recipe(DPOTrainer, keywords, batches, rows.line())


def _grpo(
    config: ml_collections.ConfigDict, codec: Any, shard: Any, keywords: dict[str, Any]
) -> _Recipe:
    """GRPO's trainer keywords (``config.grpo``, the reward function) and prompt batches."""
    prompts = data.prompt_rows(config)
    reward_fn = data.reward_function(config, prompts)
    longest = max(len(codec.encode(p)) if isinstance(p, str) else len(p) for p in prompts.prompts)
    seq_key, positions = data.model_positions(config)
    if longest + keywords["max_new_tokens"] > positions:
        raise tasks.ConfigError(
            f"config.grpo.max_new_tokens={keywords['max_new_tokens']}: the longest prompt of "
            f"config.data.prompts has {longest} tokens, and with the completion they exceed "
            f"the model's {seq_key}={positions}; give fewer new tokens, shorter "
            "prompts or a longer seq_len."
        )
    rollouts = config.max_steps // keywords["num_iterations"]
    batches = data.prompt_index_batches(
        len(prompts), batch_size=config.batch_size, rollouts=rollouts, seed=config.seed,
        shard=shard,
    )  # fmt: skip
    end_token = getattr(codec, "eos_id", None)
    keywords = {
        **keywords,
        "prompts": prompts,
        "reward_fn": reward_fn,
        "tokenizer": codec,
        "end_token": end_token,
        "metrics": GRPOMetrics,
    }
    line = (
        f"prompts: {len(prompts)} from {config.data.prompts}; {rollouts} rollouts of "
        f"{config.batch_size} prompts x {keywords['group_size']} completions, "
        f"{keywords['num_iterations']} updates each; reward {config.grpo.reward}"
    )
    return _Recipe(GRPOTrainer, keywords, batches, line)


def _train(
    config: ml_collections.ConfigDict,
    workdir: Path,
    trainer: Trainer,
    splits: datasets.Splits,
    name: str,
    spec: str,
) -> Any:
    """The writing part of ``run``: the record, the tokenizer, the fit, the final lines."""
    job.prepare_workdir(config, workdir, splits)
    say(
        f"{name} on {config.model}: {trainer.mesh.size} {jax.devices()[0].platform} devices, "
        f"mesh {dict(trainer.mesh.shape)} (strategy {spec!r}), {config.max_steps} steps of "
        f"{config.batch_size} {'pairs' if name == 'dpo' else 'prompts'}; workdir {workdir}"
    )
    cache_before = compile_cache.cache_counts()
    with warnings.catch_warnings():  # a finished run run again: said in words below
        warnings.filterwarnings("ignore", r"fit\(max_steps=\d+\) trains no step", UserWarning)
        history = trainer.fit(iter(splits.train), max_steps=config.max_steps)
    if trainer.progress.preempted:
        say(preempted_line(trainer))
        return history
    if trainer.last_step is None:
        say(
            f"nothing trained: the run in {workdir} had reached config.max_steps={config.max_steps}"
        )
        return history
    logs = history.history
    values = ", ".join(
        f"{key.removeprefix('train/')} {float(logs[key][-1]):.4f}"
        for key in _FINAL_METRICS[name]
        if logs.get(key)
    )
    say(f"final after {trainer.step} steps: {values}")
    if name == "grpo" and (rewards := logs.get("train/reward")):
        say(f"mean reward by log point: {[round(float(r), 4) for r in rewards]}")
    cache = compile_cache.cache_counts() - cache_before
    on = compile_cache.compile_cache_directory() is not None
    say(goodput_line(trainer.run.timings.goodput(), cache if on else None))
    return history
