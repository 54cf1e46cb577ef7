"""A training job from a config: built and checked before anything is written, then
trained, evaluated and reported (``run``: ``nnx-spmd-train`` without the flags)."""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

# callbacks/ is mapped onto nnx_spmd_trainer.callbacks at install time; mypy reads the tree.
from nnx_spmd_trainer import (  # type: ignore[attr-defined]
    History,
    PlanReport,
    ShardingError,
    Trainer,
    compile_cache,
    peak_flops,
    weights,
)
from nnx_spmd_trainer.app import datasets, start_from, tasks
from nnx_spmd_trainer.app.console import say
from nnx_spmd_trainer.app.job_callbacks import BaselineReport, make_callbacks, versus_baseline
from nnx_spmd_trainer.app.job_checks import (
    blamed_on,
    check_checkpoints_are_of_this_model,
    check_first_batch,
    check_init_from,
    refused_or_noted,
)
from nnx_spmd_trainer.app.job_export import check_export_format, lora_settings
from nnx_spmd_trainer.app.job_lines import (  # speed_line and the others: job.speed_line, as before
    corpus_reads_line,
    goodput_line,
    preempted_line,
    speed_line,
    started_line,
)
from nnx_spmd_trainer.app.loader import LayoutAsked, choose_layout, layout_asked
from nnx_spmd_trainer.app.run_config import averaging_and_spikes
from nnx_spmd_trainer.app.workdir import (
    check_workdir_writable,
    set_old_checkpoints_aside,
    workdir_lock,
)
from nnx_spmd_trainer.data import bytes_read_in_process


@dataclasses.dataclass(frozen=True)
class RunResult:
    """What ``run`` returns: the history, the final held-out loss and the baseline it must beat."""

    history: History
    eval_loss: float
    baseline: float
    baseline_name: str
    trainer: Trainer | None = dataclasses.field(default=None, repr=False, compare=False)
    #: The task's map of a pretrained file's names (``None``: it has none); what
    #: ``export(..., "safetensors")`` writes the parameters back through.
    weight_map: weights.WeightMap | None = dataclasses.field(
        default=None, repr=False, compare=False
    )

    @property
    def beats_baseline(self) -> bool:
        return self.eval_loss < self.baseline


def run(
    config: ml_collections.ConfigDict,
    workdir: str | os.PathLike[str],
    *,
    dry_run: bool = False,
    export_format: str = "orbax",
) -> RunResult:
    """Trains the model ``config`` describes and evaluates it: ``main`` without the flags.

    JAX must already see enough devices for ``config.strategy`` (see
    ``simulate_host_devices``). Writes ``config.json``, ``metrics.csv``, ``tb/``
    and ``checkpoints/`` under ``workdir``, and nothing before the whole run is
    built and checked: a config that cannot run (a value out of range, a
    layout that does not fit, a batch the mesh cannot split, an unwritable
    ``workdir``, or one that holds a file or checkpoints it cannot write) raises a
    ``tasks.ConfigError`` naming the key, and a resume from checkpoints of another
    model raises ``CheckpointOfAnotherModel``, with nothing written.
    With ``dry_run`` it prints the plan of the train step (``Plan.report``) and
    returns there: nothing trained, nothing written; what would refuse the run in
    ``workdir`` (it writes nothing, so it works in a read-only one) follows the plan
    as a note. ``export_format`` is the ``--export_format`` the parameters will be
    exported in (``export``): ``"safetensors"`` for a task without a weight map is
    refused here, before training.
    """
    tasks.check_config(config)
    read_before = bytes_read_in_process()
    workdir = Path(workdir)
    notes: list[str] | None = [] if dry_run else None  # a dry run notes, not refuses
    with refused_or_noted(notes, tasks.ConfigError):
        check_workdir_writable(workdir)
    layout = layout_asked(config)
    with blamed_on(f"config.{config.model}"):
        # a resumed run tokenizes with the tokenizer.json it saved (app/datasets/from_config)
        task_config = start_from.tokenizer_config(config, workdir)
        task = tasks.build_task(task_config, shard=layout.shard)
    splits = task.splits
    init_from = pretrained(config, task)
    check_export_format(config, task, export_format)
    with blamed_on("--workdir", OSError):
        run_callbacks = make_callbacks(config, workdir)
    trainer = build_trainer(config, task, layout, run_callbacks, init_from)
    strategy = choose_layout(trainer, layout.strategy, splits)
    batch = check_first_batch(config, layout.spec, trainer, splits)
    if config.resume:
        check_checkpoints_are_of_this_model(run_callbacks, notes)
    check_init_from(config, init_from, trainer, run_callbacks, notes)
    if notes is not None:
        return _dry_run(trainer, batch, splits, notes)
    started = started_line(config, workdir, trainer, strategy, layout.why, splits)
    # Checked: from here on the run writes, and no other run may write here too.
    with workdir_lock(workdir):
        result = _train(config, workdir, trainer, splits, started)
    if line := corpus_reads_line(read_before):
        print(line, flush=True)  # every process: each reads only its own rows
    return dataclasses.replace(result, weight_map=task.weight_map)


def build_trainer(
    config: ml_collections.ConfigDict,
    task: tasks.Task,
    layout: LayoutAsked,
    run_callbacks: list[Any],
    init_from: weights.Pretrained | None,
    *,
    trainer_type: Callable[..., Trainer] = Trainer,
    own: dict[str, Any] | None = None,
) -> Trainer:
    """The job's ``Trainer`` to train; what it refuses is a ``ConfigError`` naming the key.
    ``trainer_type`` with ``own``: a post-training trainer (``DPOTrainer``) given its own
    keywords (its metrics, data) in place of the task's loss and metrics."""
    splits = task.splits
    settings = averaging_and_spikes(config)  # a ConfigError naming its own key
    loss = {"loss_fn": task.loss_fn, "metrics": task.metrics} if own is None else own
    try:  # the state is built lazily: this traces the model, allocates nothing
        return trainer_type(
            task.model,
            tasks.make_optimizer(config),
            strategy=layout.strategy,
            **loss,
            callbacks=[*run_callbacks, BaselineReport(splits.baseline, splits.baseline_name)],
            seed=config.seed,
            grad_accum_steps=config.grad_accum_steps,
            max_steps_in_flight=config.max_steps_in_flight,
            peak_flops=peak_flops_of(config),
            skip_nonfinite_updates=config.skip_nonfinite_updates,
            **settings,
            **lora_settings(config),  # a ConfigError naming config.lora
            config=config,
            init_from=init_from,
            compile_cache=config.get("compile_cache", compile_cache.AUTO),
        )
    except compile_cache.CompileCacheError as error:
        raise tasks.ConfigError(f"config.compile_cache: {error}") from error
    except ShardingError as error:  # a parameter the layout cannot split
        raise tasks.ConfigError(
            f"config.strategy={layout.spec!r} (or config.{config.model}): {error}"
        ) from error
    except (ValueError, TypeError) as error:
        raise tasks.ConfigError(f"config.{config.model}: {error}") from error


def _dry_run(trainer: Trainer, batch: Any, splits: datasets.Splits, notes: list[str]) -> RunResult:
    """Prints the plan of the train step and what would refuse the run; trains nothing."""
    first = batch if batch is not None else next(iter(splits.train))
    for line in splits.summary:  # corpus sizes, the mixture, epochs per source
        say(line)
    say(str(plan_report_of(trainer, first)))
    for note in notes:
        say(f"note: the run itself would be refused: {note}")
    return RunResult(trainer.history, float("nan"), splits.baseline, splits.baseline_name, None)


#: ``config.init_from`` read (``start_from.pretrained``): kept here for its callers.
pretrained = start_from.pretrained


def prepare_workdir(
    config: ml_collections.ConfigDict, workdir: Path, splits: datasets.Splits
) -> None:
    """The first writes of a checked run: the workdir, its ``config.json`` and tokenizer
    (process 0), and, unless resuming, an earlier run's checkpoints set aside."""
    if jax.process_index() == 0:
        with blamed_on(f"--workdir={workdir} is not writable", OSError):
            workdir.mkdir(parents=True, exist_ok=True)
            (workdir / "config.json").write_text(config.to_json_best_effort(indent=2) + "\n")
            datasets.from_config.save_run_tokenizer(splits, workdir)  # predict decodes with it
    if not config.resume:
        set_old_checkpoints_aside(workdir)
        if jax.process_count() > 1:  # the others look for checkpoints only after the move
            multihost_utils.sync_global_devices("old checkpoints set aside")


def _train(
    config: ml_collections.ConfigDict,
    workdir: Path,
    trainer: Trainer,
    splits: datasets.Splits,
    started: str,
) -> RunResult:
    """The writing part of ``run``, with everything checked: trains, evaluates, reports."""
    fitted = fit_written(
        config, workdir, trainer, splits, started,
        eval_data=splits.eval, eval_every_n_steps=config.eval_every_n_steps or None,
    )  # fmt: skip
    history = fitted.history
    eval_losses = history.history.get("eval/loss", [float("nan")])
    result = RunResult(history, eval_losses[-1], splits.baseline, splits.baseline_name, trainer)
    if trainer.progress.preempted:
        say(preempted_line(trainer))
        return result
    accuracy = history.history.get("eval/accuracy", [float("nan")])[-1]
    gap = versus_baseline(result.eval_loss, splits.baseline, splits.baseline_name)
    say(
        f"final after {trainer.step} steps: eval loss {result.eval_loss:.4f} (accuracy "
        f"{accuracy:.3f}), {gap}"
    )
    if bits := splits.bits_per_byte_line(result.eval_loss):
        say(bits)
    if trainer.last_step is None:  # no step here: the speed in history is the old run's
        say(
            f"nothing trained: the run in {workdir} had reached config.max_steps="
            f"{config.max_steps}; its checkpoint was evaluated again (nnx-spmd-train evaluate "
            f"{workdir} does only that)"
        )
        return result
    if waits := history.history.get("perf/data_wait_fraction"):
        say(f"input: the steps waited for batches {100 * float(np.mean(waits)):.1f}% of the time")
    if line := speed_line(history.history, trainer.run.timings.speed.note):
        say(line)
    say(fitted.goodput_line())
    return result


@dataclasses.dataclass(frozen=True)
class Fitted:
    """A job's fit (``fit_written``): its history, and the goodput line it ends with."""

    history: History
    trainer: Trainer
    cache_before: Any  # the compile cache's counts before the fit

    def goodput_line(self) -> str:
        """Where the fit's time went, with the compile cache's hits of this fit."""
        cache = compile_cache.cache_counts() - self.cache_before
        on = compile_cache.compile_cache_directory() is not None
        return goodput_line(self.trainer.run.timings.goodput(), cache if on else None)


def fit_written(
    config: ml_collections.ConfigDict,
    workdir: Path,
    trainer: Trainer,
    splits: datasets.Splits,
    started: str,
    **fit_keywords: Any,
) -> Fitted:
    """The writing part every job shares (``run``'s and the post-training jobs'): the
    workdir's record and tokenizer, the ``started`` line, then ``fit`` on one iterator of
    ``splits.train`` to ``config.max_steps``; a finished run run again is the caller's to
    say in words (no warning)."""
    prepare_workdir(config, workdir, splits)
    say(started)
    cache_before = compile_cache.cache_counts()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"fit\(max_steps=\d+\) trains no step", UserWarning)
        history = trainer.fit(
            iter(splits.train),  # one iterator: a second fit would continue the stream
            max_steps=config.max_steps,
            **fit_keywords,
        )
    return Fitted(history, trainer, cache_before)


def peak_flops_of(config: ml_collections.ConfigDict) -> float | None:
    """One device's peak FLOP/s for ``perf/mfu``: ``config.peak_flops``, else the table's
    dense peak of this device's kind in ``config.compute_dtype``; ``None`` where neither
    gives one (the CPU): the run then logs no MFU, and its speed line says why."""
    if given := config.get("peak_flops", 0.0):
        return float(given)
    return peak_flops(jax.devices()[0].device_kind, config.get("compute_dtype", "float32"))


def plan_report_of(trainer: Trainer, batch: Any) -> PlanReport:
    """The plan report of ``trainer``'s train step on global batches shaped like ``batch``
    (this process's rows, times the row sets the processes feed)."""
    rows = trainer.placement.data_shard.count
    shapes = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((np.shape(x)[0] * rows, *np.shape(x)[1:]), x.dtype),
        jax.tree.map(np.asarray, batch),
    )
    return trainer.plan.report(shapes, train_step=trainer.train_step)
