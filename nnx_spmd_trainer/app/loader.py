"""One way from a workdir to a model: ``load_run`` builds the model, tokenizer and layout
of any run of ``nnx-spmd-train`` (plain, chat SFT, LoRA, DPO, GRPO) from its workdir,
with the parameters of a checkpoint step; what ``generate``, ``evaluate`` and ``lm_eval``
read a run with.

    from nnx_spmd_trainer.app import load_run

    run = load_run("runs/dpo")                          # the newest readable step
    run = load_run("runs/sft", step=200, strategy="fsdp=8")   # a step, another layout
    Sampler(run.model, run.plan, tokenizer=run.tokenizer).generate(["Hello"], ...)
    run.trainer.evaluate(run.splits.eval)

The workdir's ``config.json`` says what to build (the task, its sizes, LoRA, the layout)
and its ``tokenizer.json`` the text's ids. Only the model's parameters are read from the
step (``callbacks.CheckpointWeights(step, whole_model=True)``, adapters included), each
straight into the layout asked: whatever metrics and optimizer the run kept (a DPO run's,
a GRPO run's), neither is read. A step that cannot be read as this model raises
(``CheckpointOfAnotherModel``, ``DamagedCheckpoint``); it never hands back fresh weights.
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import json
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import ml_collections
import optax

# callbacks/ is mapped onto nnx_spmd_trainer.callbacks at install time; mypy reads the tree.
from nnx_spmd_trainer import (  # type: ignore[attr-defined]
    Auto,
    DataParallel,
    ShardingError,
    Trainer,
    callbacks,
    weights,
)
from nnx_spmd_trainer.app import datasets, start_from, tasks
from nnx_spmd_trainer.app.console import say
from nnx_spmd_trainer.app.job_checks import blamed_on
from nnx_spmd_trainer.app.job_export import lora_settings

__all__ = ["LayoutAsked", "LoadedRun", "choose_layout", "layout_asked", "load_run", "run_config"]

#: The workdir's record of the config its run trained with.
CONFIG_FILE = "config.json"

#: What ``load_run`` raises for a run it cannot read (each one line, naming the fix): what
#: a command turns into its one-line refusal.
NOT_READ: tuple[type[Exception], ...] = (
    tasks.ConfigError,
    ShardingError,
    callbacks.CheckpointOfAnotherModel,
    callbacks.DamagedCheckpoint,
)


class LayoutAsked(NamedTuple):
    """``config.strategy`` read: the spec fitted to the devices (and ``why``, when it was
    changed to fit), the strategy (or ``Auto``) and the rows this process reads."""

    spec: str
    why: str
    strategy: Any  # a Strategy, or Auto
    shard: Any  # a DataShard


def layout_asked(config: ml_collections.ConfigDict) -> LayoutAsked:
    """``config.strategy`` (with ``config.across_hosts``) as a run lays its model out; a
    ``ConfigError`` naming the key if it cannot."""
    across = config.get("across_hosts", "")
    with blamed_on(f"config.strategy={config.strategy!r}"):
        # "fsdp=-1,model=2" (the default job) fits itself to the devices there are.
        spec, why = tasks.fit_to_devices(config.strategy, jax.device_count())
        if spec == "auto":  # chosen later, holding each process to DataParallel's rows
            if across:
                raise tasks.ConfigError(
                    f"config.across_hosts={across!r} places the axes of a strategy spec "
                    "(--config.strategy=data=2,fsdp=4), not those 'auto' chooses."
                )
            auto = Auto(memory_budget_bytes=config.memory_budget_bytes or None, print_fn=say)
            shard = DataParallel().data_shard(DataParallel().make_mesh())
            return LayoutAsked(spec, why, auto, shard)
        strategy = tasks.parse_strategy(spec, config.get("sequence_attention", "all_gather"))
        if across:  # what the strategy alone cannot do is the strategy's, not across_hosts'
            strategy.make_mesh()
    with blamed_on(
        f"config.across_hosts={across!r}" if across else f"config.strategy={config.strategy!r}"
    ):
        strategy = tasks.spanning_hosts(strategy, across)
        # Which rows this process reads is a question of the layout: the strategy says.
        # The trainer's placement.data_shard would say the same, but the data is needed
        # before there is a trainer: a task builds its model with its data (the GPT's
        # vocabulary is its text's), and "auto" chooses the layout on that data. So the
        # strategy answers on the mesh the trainer's plan will build from the same
        # devices; from the trainer on, trainer.placement is asked.
        shard = strategy.data_shard(strategy.make_mesh())
    return LayoutAsked(spec, why, strategy, shard)


def choose_layout(trainer: Trainer, strategy: Any, splits: datasets.Splits) -> Any:
    """The strategy the trainer runs in: ``strategy``, or with ``Auto`` the one chosen now,
    planned and timed on the first batches as ``fit`` would."""
    if not isinstance(strategy, Auto):
        return strategy
    with blamed_on(
        f"config.strategy='auto' (config.memory_budget_bytes={strategy.memory_budget_bytes})"
    ):
        return trainer.choose_layout(itertools.islice(iter(splits.train), strategy.steps)).strategy


def run_config(workdir: str | os.PathLike[str]) -> ml_collections.ConfigDict:
    """The config ``workdir``'s run trained with (its ``config.json``); a ``ConfigError``
    naming the file when it is missing or unreadable."""
    record = Path(workdir) / CONFIG_FILE
    try:
        values = json.loads(record.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise tasks.ConfigError(
            f"{record} does not exist: {workdir} is not the --workdir of a run "
            "(nnx-spmd-train --workdir=DIR writes one)."
        ) from None
    except (OSError, ValueError) as error:
        raise tasks.ConfigError(f"{record} does not read as the run's config: {error}") from None
    return ml_collections.ConfigDict(values)


def saved_steps(workdir: str | os.PathLike[str]) -> list[int]:
    """The step numbers in ``workdir/checkpoints`` (finished or not), oldest first."""
    folder = Path(workdir) / start_from.CHECKPOINTS
    if not folder.is_dir():
        return []
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit() and p.is_dir())


def best_step(workdir: str | os.PathLike[str], saved: Sequence[int]) -> int:
    """The saved step with the lowest ``eval/loss`` in ``workdir/metrics.csv`` (the CLI's
    checkpoints record no monitored value: its ``metrics.csv`` does)."""
    losses: dict[int, float] = {}
    try:
        with (Path(workdir) / "metrics.csv").open(encoding="utf-8", newline="") as file:
            for row in csv.DictReader(file):
                if row.get("eval/loss") and row.get("step", "").isdigit():
                    losses[int(row["step"])] = float(row["eval/loss"])
    except OSError:
        pass
    scored = [(losses[s], s) for s in saved if s in losses and math.isfinite(losses[s])]
    if not scored:
        raise tasks.ConfigError(
            f"step='best': no saved step {sorted(saved)} has an eval/loss in "
            f"{Path(workdir) / 'metrics.csv'}; give the latest step or a step number."
        )
    return min(scored)[1]


@dataclasses.dataclass(frozen=True)
class _SavedModel(weights.Pretrained):
    """The model of the first readable step of ``steps`` (newest first), every parameter
    read from it, adapters included. A damaged step is said in one line and the one
    before it read when ``fall_back``; else it raises. ``read`` holds the step read."""

    steps: tuple[Path, ...] = ()
    fall_back: bool = True
    print_fn: Callable[[str], None] | None = None
    read: list[int] = dataclasses.field(default_factory=list)

    def state(self, plan: Any) -> Any:
        for n, step_dir in enumerate(self.steps):
            try:
                try:
                    found = callbacks.CheckpointWeights(step_dir, whole_model=True)
                except ValueError as unfinished:  # no commit marker: a step cut short
                    raise callbacks.DamagedCheckpoint(str(unfinished)) from unfinished
                params = found.params(plan)
            except callbacks.DamagedCheckpoint as error:
                later = self.steps[n + 1 :]
                if not self.fall_back or not later:
                    raise callbacks.DamagedCheckpoint(
                        f"{error}; no earlier step of {step_dir.parent} to read instead"
                        if self.fall_back
                        else str(error)
                    ) from error
                if self.print_fn is not None:
                    self.print_fn(f"{error}; reading step {later[0].name} instead")
                continue
            self.read.append(found.step)
            return weights.pretrained_state(plan, params)
        raise callbacks.DamagedCheckpoint(f"{self.source} holds no checkpoint step to read")


@dataclasses.dataclass(frozen=True)
class LoadedRun:
    """A run's model, read back (``load_run``).

    Attributes:
      trainer: a ``Trainer`` holding the model in the layout asked (``trainer.model``,
        ``trainer.plan``; ``trainer.evaluate`` scores it with the task's loss and metrics).
        Its optimizer is none (``optax.set_to_zero``): it is for reading, not training.
      tokenizer: the run's text codec (its ``tokenizer.json``, or the chat codec of a chat
        run); ``None`` for a task that is not text.
      config: the config the run trained with (``config.json``), as built.
      splits: the task's data (``splits.eval``: the held-out batches).
      step: the checkpoint step read, or ``None`` where ``weights`` were read instead.
      source: where the weights came from, in words (``"step 40 of runs/dpo"``).
      weight_map: the task's map of a pretrained file's names, or ``None``.
    """

    trainer: Trainer
    tokenizer: Any
    config: ml_collections.ConfigDict
    splits: Any  # the task's datasets.Splits (the app's; not in the API reference)
    step: int | None
    source: str
    weight_map: weights.WeightMap | None = None

    @property
    def model(self) -> Any:
        """The model, its parameters from the step."""
        return self.trainer.model

    @property
    def plan(self) -> Any:
        """The plan of the layout the model is in (what ``Sampler`` and ``HarnessLM`` take)."""
        return self.trainer.plan


def load_run(
    workdir: str | os.PathLike[str] | None,
    *,
    step: int | str = "latest",
    strategy: str | None = None,
    weights_file: str | os.PathLike[str] | None = None,
    config: ml_collections.ConfigDict | None = None,
    print_fn: Callable[[str], None] | None = say,
) -> LoadedRun:
    """The model, tokenizer and layout of the run in ``workdir``, with a checkpoint's
    parameters.

    Args:
      workdir: the ``--workdir`` of a run of ``nnx-spmd-train`` (its ``config.json``,
        ``tokenizer.json`` and ``checkpoints/``); ``None`` with ``config`` and
        ``weights_file``.
      step: ``"latest"`` (the newest step; a damaged one is said in one line through
        ``print_fn`` and the one before it read), ``"best"`` (the saved step with the
        lowest ``eval/loss`` in ``metrics.csv``) or a step number (read, or refused).
      strategy: a strategy spec (``"fsdp=4,model=2"``, ``"auto"``) to lay the model out
        in, in place of the run's ``config.strategy``.
      weights_file: a safetensors file (or folder) read through the task's weight map in
        place of the checkpoint (the run's ``--export_format=safetensors``, Hugging
        Face's GPT-2).
      config: the config to build, in place of ``workdir/config.json``.
      print_fn: where a damaged step skipped is said (``None``: nowhere).

    A workdir without a config or a checkpoint, a config that does not build here or a
    step that is not there raises the app's ``ConfigError`` (``tasks.ConfigError``); a
    step of another model ``callbacks.CheckpointOfAnotherModel`` (names, shapes); no
    step that can be read ``callbacks.DamagedCheckpoint`` (the last one's damage).
    """
    if config is None:
        if workdir is None:
            raise tasks.ConfigError("load_run needs a workdir, or a config and a weights_file.")
        config = run_config(workdir)
    config = ml_collections.ConfigDict(config.to_dict())  # the caller's stays as it was
    if strategy is not None:
        config.strategy = strategy
    init_from, steps = _weights_to_read(workdir, step, weights_file, print_fn)
    layout = layout_asked(config)
    with blamed_on(f"config.{config.model}"):
        task_config = config
        if workdir is not None:  # the run's own tokenizer.json, where it saved one
            task_config = datasets.from_config.run_tokenizer_config(config, workdir)
        task = tasks.build_task(task_config, shard=layout.shard)
    if weights_file is not None:
        init_from = _weights_file(config, task, weights_file)
    trainer = _reading_trainer(config, task, layout, init_from)
    choose_layout(trainer, layout.strategy, task.splits)
    trainer.model  # noqa: B018  (reads the step now: what cannot be read raises here)
    if isinstance(init_from, _SavedModel):
        read = init_from.read[-1] if init_from.read else int(steps[0].name)
        source = f"step {read} of {workdir}"
    else:
        read, source = None, str(weights_file)
    return LoadedRun(
        trainer=trainer,
        tokenizer=task.splits.text_codec,
        config=config,
        splits=task.splits,
        step=read,
        source=source,
        weight_map=task.weight_map,
    )


def _weights_to_read(
    workdir: str | os.PathLike[str] | None,
    step: int | str,
    weights_file: str | os.PathLike[str] | None,
    print_fn: Callable[[str], None] | None,
) -> tuple[Any, tuple[Path, ...]]:
    """The ``Pretrained`` a checkpoint is read through, and the steps it tries (newest
    first); ``(None, ())`` where a weights file is read instead (built with the task)."""
    if weights_file is not None:
        if not Path(weights_file).exists():
            raise tasks.ConfigError(f"weights {weights_file}: there is no file or folder there.")
        return None, ()
    assert workdir is not None
    folder = Path(workdir).absolute() / start_from.CHECKPOINTS
    saved = saved_steps(workdir)
    if not saved:
        raise tasks.ConfigError(
            f"no checkpoint in {folder}: train first (nnx-spmd-train --workdir={workdir}), or "
            "name the workdir of a run that saved one."
        )
    if step == "latest":
        chosen, fall_back = sorted(saved, reverse=True), True
    elif step == "best":
        chosen, fall_back = [best_step(workdir, saved)], False
    else:
        try:
            number = int(step)
        except (TypeError, ValueError):
            raise tasks.ConfigError(
                f"step={step!r}: give 'latest', 'best' or a step number."
            ) from None
        if number not in saved:
            raise tasks.ConfigError(
                f"step={number}: there is no checkpoint step {number} in {folder} (steps "
                f"there: {saved})."
            )
        chosen, fall_back = [number], False
    steps = tuple(folder / str(s) for s in chosen)
    reader = _SavedModel(
        source=folder, weight_map=weights.WeightMap({}), steps=steps, fall_back=fall_back,
        print_fn=print_fn,
    )  # fmt: skip
    return reader, steps


def _weights_file(
    config: ml_collections.ConfigDict, task: tasks.Task, path: str | os.PathLike[str]
) -> weights.Pretrained:
    if task.weight_map is None:
        raise tasks.ConfigError(
            f"--weights={path}: config.model={config.model!r} has no weight map to read a "
            "safetensors file through (gpt2_hf has one); leave --weights out to read the "
            "run's checkpoint."
        )
    return weights.Pretrained(path, task.weight_map)


def _reading_trainer(
    config: ml_collections.ConfigDict, task: tasks.Task, layout: LayoutAsked, init_from: Any
) -> Trainer:
    """A ``Trainer`` of the run's model (LoRA's adapters too) in ``layout``, its first
    state ``init_from``'s; no optimizer state (it reads, it does not train)."""
    try:  # the state is built lazily: this traces the model, allocates nothing
        return Trainer(
            task.model,
            optax.set_to_zero(),
            strategy=layout.strategy,
            loss_fn=task.loss_fn,
            metrics=task.metrics,
            seed=config.seed,
            **lora_settings(config),  # a ConfigError naming config.lora
            config=config,
            init_from=init_from,
        )
    except (ValueError, TypeError) as error:
        raise tasks.ConfigError(
            f"config.strategy={layout.spec!r} (or config.{config.model}): {error}"
        ) from error
