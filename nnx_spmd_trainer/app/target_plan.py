"""``--dry_run --config.target=v5e-16``: the plan of the job's train step for TPU chips
that are not here, compiled by the TPU compiler on this CPU (``nnx_spmd_trainer.Target``).

The task (model, data, loss) is the job's own; the layout is ``config.strategy`` fitted
to the target's chips (``"auto"``: the layouts ranked for the chips by the compiler and
the roofline), the batch the job's first, at ``config.batch_size`` rows.
``--config.target_batch=max`` also finds the largest global batch that fits, printing
every compile it took. ``--config=dpo|grpo``: the post-training step and each phase
(``post_training_job.plan_for_target``). Nothing is trained or written; a step the
compiler refuses is a report that does not fit, and the command still exits 0.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import ml_collections
import numpy as np

from nnx_spmd_trainer import Plan, Target, target_choice
from nnx_spmd_trainer.app import post_training_job, tasks
from nnx_spmd_trainer.app.console import say
from nnx_spmd_trainer.app.job_export import lora_settings
from nnx_spmd_trainer.app.run_config import (
    averaging_and_spikes,
    fit_to_devices,
    make_optimizer,
    parse_strategy,
)


def _target(config: ml_collections.ConfigDict) -> Target:
    try:
        target = Target.parse(config.target)
        target.devices  # noqa: B018  libtpu's chips: a missing libtpu is said here
    except (ValueError, RuntimeError) as error:
        raise tasks.ConfigError(f"config.target={config.target!r}: {error}") from error
    return target


def _resized(batch: Any, rows: int) -> Any:
    """``batch``'s shapes with ``rows`` rows."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((rows, *np.shape(x)[1:]), np.asarray(x).dtype), batch
    )


def _padding_hint(error: Exception, config: ml_collections.ConfigDict) -> str:
    """A sharding refusal with the padding that would divide (a vocabulary of 50257
    under a 2-way model axis: 50304, a multiple of 128)."""
    vocab = config.get(config.model, {}).get("vocab_size")
    if not vocab or vocab % 128 == 0:
        return str(error)
    padded = math.ceil(vocab / 128) * 128
    return (
        f"{error} The vocabulary ({vocab}) may not divide a mesh axis: pad it to a "
        f"multiple of 128 (--config.{config.model}.vocab_size={padded}), as the zoo does."
    )


def dry_run(config: ml_collections.ConfigDict, *, dry_run: bool) -> int:
    """Prints the plan for ``config.target``'s chips; returns the exit status (0)."""
    if not dry_run:
        raise tasks.ConfigError(
            f"config.target={config.target!r} plans for chips that are not here: add "
            "--dry_run (a run happens on the chips themselves, without config.target)."
        )
    target = _target(config)
    if config.get("post_training"):  # --config=dpo|grpo: the step and each phase
        say(f"planning for {target.name}: {target.chips} {target.chip.name} chips (not here)")
        post_training_job.plan_for_target(config, target)
        return 0
    spec, why = fit_to_devices(config.strategy, target.chips)
    task = tasks.build_task(config)
    batch = next(iter(task.splits.train))
    shapes = _resized(batch, config.batch_size)
    kwargs: dict[str, Any] = {
        "loss_fn": task.loss_fn,
        "metrics": task.metrics,
        "seed": config.seed,
        "grad_accum_steps": config.grad_accum_steps,
        "skip_nonfinite_updates": config.skip_nonfinite_updates,
        **averaging_and_spikes(config),
        **lora_settings(config),
    }
    optimizer = make_optimizer(config)
    say(f"planning for {target.name}: {target.chips} {target.chip.name} chips (not here)")
    try:
        if spec == "auto":
            choice = target_choice.choose(
                task.model, optimizer, shapes, devices=target.devices, target=target.name, **kwargs
            )
            say(choice.table())
            plan, report = choice.plan, choice.report
        else:
            strategy = parse_strategy(spec, config.get("sequence_attention", "all_gather"))
            if why:
                say(f"config.strategy: {why}")
            plan = Plan(task.model, optimizer, strategy=strategy, target=target, **kwargs)
            report = plan.report(shapes)
    except ValueError as error:  # a mesh or a dimension the chips do not divide
        raise tasks.ConfigError(
            f"config.strategy={config.strategy!r} on config.target={config.target!r}: "
            + _padding_hint(error, config)
        ) from error
    say(str(report))
    if config.get("target_batch", "") == "max":
        step = math.prod(plan.mesh.shape[a] for a in plan.batch_axes()) * config.grad_accum_steps
        found = target_choice.largest_batch(
            plan,
            lambda rows: _resized(batch, rows),
            start=max(step, config.batch_size),
            step=step,
        )
        for rows, fits, peak in found.compiles:
            say(f"  compiled {rows} rows: {'fits' if fits else 'does not fit'}, peak {peak:,} B")
        say(found.lines()[0])
    return 0
