"""What refuses a job before anything is written: each refusal a ``ConfigError`` naming
the config key at fault (``blamed_on``), or, in a dry run, a note (``refused_or_noted``)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grain
import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

# callbacks/ is mapped onto nnx_spmd_trainer.callbacks at install time; mypy reads the tree.
from nnx_spmd_trainer import Trainer, callbacks, data, weights  # type: ignore[attr-defined]
from nnx_spmd_trainer.app import datasets, tasks
from nnx_spmd_trainer.app.console import say
from nnx_spmd_trainer.app.job_lines import sizes_line


@contextlib.contextmanager
def blamed_on(key: str, *errors: type[BaseException]) -> Iterator[None]:
    """Re-raises ``errors`` (default ``ValueError``, ``TypeError``) raised inside as a
    ``ConfigError`` whose message starts with ``key``; a ``ConfigError`` names its own key."""
    caught = errors or (ValueError, TypeError)
    try:
        yield
    except tasks.ConfigError:
        raise
    except caught as error:
        raise tasks.ConfigError(f"{key}: {error}") from error


@contextlib.contextmanager
def refused_or_noted(notes: list[str] | None, *errors: type[Exception]) -> Iterator[None]:
    """``errors`` raised inside propagate (they refuse the run), or, with ``notes`` (a dry
    run, which writes nothing and need not be refused), are kept there as messages."""
    try:
        yield
    except errors as error:
        if notes is None:
            raise
        notes.append(str(error))


def first_batch(data: Any) -> Any:
    """The first batch of ``data`` without consuming it (``None``: none, or a one-pass
    iterator); a Grain ``MapDataset`` or a sequence is indexed, starting no workers."""
    if isinstance(data, grain.MapDataset | Sequence):
        try:
            return data[0]
        except IndexError:
            return None
    iterator = iter(data)
    return None if iterator is data else next(iterator, None)


def check_first_batch(
    config: ml_collections.ConfigDict, spec: str, trainer: Trainer, splits: datasets.Splits
) -> Any:
    """The first training batch (``None``: not to be had without taking it), checked as
    ``fit`` will place it; each refusal names the key at fault."""
    accumulation = f" with config.grad_accum_steps={config.grad_accum_steps}"
    batch_key = (
        f"config.batch_size={config.batch_size}"
        f"{accumulation if config.grad_accum_steps > 1 else ''}"
    )
    with blamed_on(batch_key):
        batch = first_batch(splits.train)
    # The layout's answer for the batch: a sequence SequenceParallel cannot split is the
    # sequence length's fault (or the layout's), not the batch size's.
    seq_len = config.get(config.model, {}).get("seq_len")
    with blamed_on(
        f"config.strategy={spec!r}"
        + (f" with config.{config.model}.seq_len={seq_len}" if seq_len else "")
    ):
        shardings = trainer.placement.shardings(batch) if batch is not None else None
    with blamed_on(batch_key):
        if batch is not None:
            data.check_batch(
                batch,
                shardings,
                divisor=config.grad_accum_steps,
                data_shards=trainer.placement.data_shard.count,
            )
    return batch


def check_checkpoints_are_of_this_model(run_callbacks: list[Any], notes: list[str] | None) -> None:
    """The checkpoints to resume must be of this model (``CheckpointOfAnotherModel``)."""
    with refused_or_noted(notes, callbacks.CheckpointOfAnotherModel):
        for callback in run_callbacks:
            if isinstance(callback, callbacks.OrbaxCheckpoint):
                callback.check_model()
    if jax.process_count() > 1:
        # Every process has looked before any creates the directory: they all saw the
        # same files, so all opened the same Orbax managers (whose barriers count).
        multihost_utils.sync_global_devices("checkpoints checked against the model")


def check_init_from(
    config: ml_collections.ConfigDict,
    init_from: Any,  # weights.Pretrained
    trainer: Trainer,
    run_callbacks: list[Any],
    notes: list[str] | None,
) -> None:
    """``config.init_from`` must fit the model (names, shapes, an undamaged file), unless
    the run resumes from its own checkpoints, which win and never read it."""
    if init_from is None:
        return
    resumes = config.resume and any(
        isinstance(callback, callbacks.OrbaxCheckpoint) and callback.resumes()
        for callback in run_callbacks
    )
    if resumes:
        return
    with refused_or_noted(notes, tasks.ConfigError):
        try:
            init_from.check(trainer.plan)
        except weights.WeightsMismatch as error:  # one line, as the CLI's refusals are
            problems = " ".join(line.strip() for line in str(error).splitlines())
            raise tasks.ConfigError(
                f"config.init_from={config.init_from!r}: {problems} Pass weights of "
                f"config.model={config.model!r}, or --config.init_from='' to start from "
                "random weights."
            ) from error
        except callbacks.CheckpointOfAnotherModel as error:  # an earlier run's checkpoint
            sizes = sizes_line(config, Path(init_from.source))  # the keys that set the shapes
            raise tasks.ConfigError(
                f"config.init_from={config.init_from!r}: {error} {sizes} Or start from a run "
                f"of this config's model, or --config.init_from='' to start from random weights."
            ) from error
        if isinstance(init_from, callbacks.CheckpointWeights):  # said here: a resume never reads it
            say(f"init_from: the model of {init_from.source}; the optimizer starts fresh")


#: The keys ``run_config.make_optimizer`` plans the learning-rate schedule from.
SCHEDULE_KEYS = ("max_steps", "learning_rate", "warmup_steps", "end_lr_fraction")


def schedule_change_on_resume(config: ml_collections.ConfigDict, workdir: str | Path) -> str | None:
    """Refuses (``ConfigError``) a resume whose learning-rate schedule is not the one the
    workdir's checkpoints were trained on (the CLI plans it from ``SCHEDULE_KEYS``: the lr
    would jump at the step resumed from); with ``config.replan_schedule`` returns the line
    that says the change instead. ``None``: no resume, or the same schedule."""
    workdir = Path(workdir)
    checkpoints = workdir / "checkpoints"
    steps = (
        [int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()]
        if config.get("resume", True) and checkpoints.is_dir()
        else []
    )
    try:
        before = json.loads((workdir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # no record of the schedule the checkpoints were trained on
    if not steps or not all(key in before for key in SCHEDULE_KEYS):
        return None
    step = max(steps)
    old = {key: before[key] for key in SCHEDULE_KEYS}
    new = {key: config.get(key) for key in SCHEDULE_KEYS}
    lr_old, lr_new = (float(_learning_rate(values, step)) for values in (old, new))
    changed = [key for key in SCHEDULE_KEYS if old[key] != new[key]]
    ahead = np.arange(step, max(old["max_steps"], new["max_steps"]) + 1)
    if not changed or np.allclose(_learning_rate(old, ahead), _learning_rate(new, ahead)):
        return None  # e.g. a constant lr: max_steps plans nothing
    what = ", ".join(f"config.{key}={new[key]!r} (was {old[key]!r})" for key in changed)
    if config.get("replan_schedule", False):
        return (
            f"resuming at step {step} on a re-planned learning-rate schedule: {what}; the lr "
            f"of step {step + 1} is {lr_new:.3g} where the checkpoints' schedule had {lr_old:.3g}"
        )
    raise tasks.ConfigError(
        f"{what}: the checkpoints in {checkpoints} (step {step}) were trained on the "
        f"learning-rate schedule of the old values, and resuming would re-plan it: the lr of "
        f"step {step + 1} would jump from {lr_old:.3g} to {lr_new:.3g}. Pass the old values to "
        "finish the run as planned, --config.replan_schedule=True to resume on the new "
        "schedule anyway, or --config.resume=False to start over."
    )


def _learning_rate(values: dict[str, Any], steps: Any) -> np.ndarray:
    """The CLI's scheduled learning rate at ``steps`` for the ``SCHEDULE_KEYS`` ``values``."""
    return np.asarray(tasks.schedule(ml_collections.ConfigDict(values))(steps), np.float64)
