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
from pathlib import Path
from typing import Any

import jax
import ml_collections
import numpy as np

# callbacks/ is mapped onto nnx_spmd_trainer.callbacks at install time; mypy reads the tree.
from nnx_spmd_trainer import DataParallel, Trainer  # type: ignore[attr-defined]
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
from nnx_spmd_trainer.app.job_export import check_export_format, lora_settings
from nnx_spmd_trainer.app.job_lines import preempted_line
from nnx_spmd_trainer.app.post_training_phases import check_rollout_fits, phases
from nnx_spmd_trainer.app.workdir import (
    check_workdir_writable,
    workdir_lock,
)
from nnx_spmd_trainer.post_training import (
    DPOMetrics,
    DPOTrainer,
    GRPOMetrics,
    GRPOTrainer,
    ReferenceModel,
    RewardError,
    encode_prompt,
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
    budget = int(config.get("memory_budget_bytes") or 0) or None
    if notes is not None or (budget and name == "grpo"):
        first = batch if batch is not None else next(iter(splits.train))
        _plan_every_phase(config, trainer, first, budget, dry_run=notes is not None)
    if notes is not None:
        say(f"dry run: the {name} job's keys, data and layout checked; nothing trained or written")
        for note in notes:
            say(f"note: the run itself would be refused: {note}")
        return job.RunResult(trainer.history, float("nan"), float("nan"), "", None)
    with workdir_lock(workdir):
        try:
            history = _train(config, workdir, trainer, splits, name, layout.spec)
        except RewardError as error:  # raised mid-run, before the step it would feed
            raise tasks.ConfigError(f"config.grpo.reward={config.grpo.reward!r}: {error}") from None
    return job.RunResult(
        history, float("nan"), float("nan"), "", trainer, weight_map=task.weight_map
    )


def plan_for_target(config: ml_collections.ConfigDict, target: Any) -> None:
    """``--config=dpo|grpo --dry_run --config.target=T``: the post-training step and each
    phase (the reference pass, GRPO's rollout) planned for the target's chips, compiled
    by their compiler on this CPU; this process reads every row (nothing is written)."""
    name = kind(config)
    if name not in KINDS:
        raise tasks.ConfigError(
            f"config.post_training={name!r}: must be one of {', '.join(map(repr, KINDS))}."
        )
    keys = data.grpo_keys(config) if name == "grpo" else data.dpo_keys(config)
    spec, why = tasks.fit_to_devices(config.strategy, target.chips)
    if spec == "auto":
        raise tasks.ConfigError(
            f"config.strategy='auto' with config.target={config.target!r}: a {name} plan "
            "for a target takes a strategy spec (--config.strategy=fsdp=-1)."
        )
    if why:
        say(f"config.strategy: {why}")
    task = tasks.build_task(config)
    codec = task.splits.text_codec
    if codec is None:
        raise tasks.ConfigError(f"config.model={config.model!r}: post-training needs a text task.")
    every_row = DataParallel().data_shard(DataParallel().make_mesh())
    recipe = (_dpo if name == "dpo" else _grpo)(config, codec, every_row, keys)
    strategy = tasks.parse_strategy(spec, config.get("sequence_attention", "all_gather"))
    try:
        trainer = recipe.trainer_type(
            task.model, tasks.make_optimizer(config), strategy=strategy,
            devices=target.devices, seed=config.seed, grad_accum_steps=config.grad_accum_steps,
            **lora_settings(config), **recipe.keywords,
        )  # fmt: skip
    except (ValueError, TypeError) as error:  # a layout the chips or the model refuse
        raise tasks.ConfigError(f"config.strategy={spec!r} on {target.name}: {error}") from error
    say(recipe.data_line)
    budget = int(config.get("memory_budget_bytes") or 0) or None
    _plan_every_phase(config, trainer, next(iter(recipe.batches)), budget, dry_run=True)


def step_batch_stand_in(trainer: Trainer, batch: dict[str, Any]) -> dict[str, Any]:
    """What the train step reads once ``prepare_batch`` has made it from ``batch`` (this
    process's rows), as a plan takes it: DPO's pairs with zeros for the reference's
    log-probabilities; GRPO's rollout of ``batch["row"]``'s prompts as the rollout stage
    declares it (``GRPOTrainer.rollout_spec``: shapes, nothing sampled)."""
    if isinstance(trainer, DPOTrainer):
        rows = np.shape(batch["chosen_inputs"])[0]
        return {**batch, **{key: np.zeros(rows, np.float32) for key in ReferenceModel.KEYS}}
    if isinstance(trainer, GRPOTrainer):
        return trainer.rollout_spec(np.shape(batch["row"])[0])
    return batch


def _plan_every_phase(
    config: ml_collections.ConfigDict,
    trainer: Trainer,
    first: dict[str, Any],
    budget: int | None,
    *,
    dry_run: bool,
) -> None:
    """The plan of the step on ``first``'s global shapes and each phase's peak per device
    (``post_training_phases``), said in a dry run; a GRPO rollout that cannot fit beside
    the policy under ``budget`` (``config.memory_budget_bytes``) refused in one line."""
    local = step_batch_stand_in(trainer, first)
    count = trainer.placement.data_shard.count
    shapes = {
        key: jax.ShapeDtypeStruct((np.shape(x)[0] * count, *np.shape(x)[1:]), x.dtype)
        for key, x in local.items()
    }
    report = trainer.plan.report(
        shapes, train_step=trainer.train_step, notes=[getattr(trainer, "log_prob_note", None)]
    )  # DPOTrainer's and GRPOTrainer's: why their log-probabilities read whole logits
    phase_list = phases(trainer, int(report.memory["peak"]), shapes)
    if dry_run:
        say(str(report))
        say("memory per device of each phase (the compiler's analysis):")
        for phase in phase_list:
            say(phase.line())
    key = f"config.memory_budget_bytes={budget}"
    check_rollout_fits(trainer, phase_list, budget, key)


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
    longest = max(len(encode_prompt(codec, p)) for p in prompts.prompts)
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
    # A chat run's completions end at its template's end of turn, else at the end of text.
    end_token = getattr(codec, "end_of_turn_id", None)
    if end_token is None:
        end_token = getattr(codec, "eos_id", None)
    keywords = {
        **keywords,
        "prompts": prompts,
        "reward_fn": reward_fn,
        "tokenizer": codec,
        "end_token": end_token,
        "stop": _stop_strings(config),
        "metrics": GRPOMetrics,
    }
    line = (
        f"prompts: {len(prompts)} from {config.data.prompts}; {rollouts} rollouts of "
        f"{config.batch_size} prompts x {keywords['group_size']} completions, "
        f"{keywords['num_iterations']} updates each; reward {config.grpo.reward}"
    )
    return _Recipe(GRPOTrainer, keywords, batches, line)


def _stop_strings(config: ml_collections.ConfigDict) -> tuple[str, ...]:
    """``config.grpo.stop``: a string, or a tuple of strings, that ends a completion; a
    ``ConfigError`` naming the key for anything else."""
    stop = config.grpo.get("stop", ()) or ()
    strings = (stop,) if isinstance(stop, str) else tuple(stop)
    if not all(isinstance(s, str) and s for s in strings):
        raise tasks.ConfigError(
            f"config.grpo.stop={stop!r}: give a non-empty string, or a tuple of them, that "
            "ends a completion (e.g. --config.grpo.stop='\\n')."
        )
    return strings


def _train(
    config: ml_collections.ConfigDict,
    workdir: Path,
    trainer: Trainer,
    splits: datasets.Splits,
    name: str,
    spec: str,
) -> Any:
    """The writing part of ``run``: the record, the tokenizer, the fit, the final lines."""
    started = (
        f"{name} on {config.model}: {trainer.mesh.size} {jax.devices()[0].platform} devices, "
        f"mesh {dict(trainer.mesh.shape)} (strategy {spec!r}), {config.max_steps} steps of "
        f"{config.batch_size} {'pairs' if name == 'dpo' else 'prompts'}; workdir {workdir}"
    )
    fitted = job.fit_written(config, workdir, trainer, splits, started)
    history = fitted.history
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
    say(fitted.goodput_line())
    return history
