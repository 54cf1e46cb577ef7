"""The memory of each phase of a post-training step, per device, before the run: the
learning step, the reference pass and, for GRPO, the rollout's prefill and decode (with
the key-value cache's bytes), each from the compiler's memory analysis of its program
lowered on shapes alone (no array is built, nothing runs).

A GRPO rollout runs beside the policy: the training state (and a reference copy) stays
on the devices while the sampler's programs run. ``check_rollout_fits`` refuses, in one
line with the numbers, a rollout that cannot fit beside them under the budget.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx

from nnx_spmd_trainer import Sampler, Sampling
from nnx_spmd_trainer.app.run_config import ConfigError
from nnx_spmd_trainer.post_training import DPOTrainer, GRPOTrainer

__all__ = ["Phase", "check_rollout_fits", "phases", "size"]


def size(n: int) -> str:
    """Bytes in the largest unit that keeps a number above 1.

    >>> size(3 * 2**20), size(512)
    ('3.0 MiB', '512 B')
    """
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def compiled_peak(compiled: Any) -> int:
    """A compiled program's peak per device, as ``PlanReport.memory["peak"]`` counts it."""
    a = compiled.memory_analysis()
    return int(
        a.argument_size_in_bytes
        + a.output_size_in_bytes
        - a.alias_size_in_bytes
        + a.temp_size_in_bytes
        + a.generated_code_size_in_bytes
    )


@dataclasses.dataclass(frozen=True)
class Phase:
    """One phase's peak per device (its program's arguments, outputs and temporaries)."""

    name: str
    peak_bytes: int
    note: str = ""

    def line(self) -> str:
        return f"  {self.name}: peak {size(self.peak_bytes)}{self.note}"


def _abstract_model(trainer: Any) -> tuple[Any, nnx.Module, Any]:
    """The policy as shapes with the plan's shardings: ``(graphdef, module, state)``."""
    objects = nnx.merge(trainer.plan.graphdef, trainer.plan.state_targets())
    model = objects["model"]
    graphdef, state = nnx.split(model)
    return graphdef, model, state


def _forward_peak(trainer: Any, fn: Any, batch: dict[str, Any]) -> int:
    """The peak of ``fn(model, batch)`` as the plan's forward program of the policy."""
    graphdef, _, state = _abstract_model(trainer)
    program = trainer.plan.forward_program(fn, graphdef, state, batch)
    with jax.set_mesh(trainer.plan.mesh):
        return compiled_peak(program.lower(state, batch).compile())


def phases(trainer: Any, step_peak: int, step_batch: dict[str, Any]) -> list[Phase]:
    """Each phase of ``trainer``'s step on the global batch ``step_batch`` (shapes): the
    learning step (``step_peak``, the plan report's), the reference pass, and GRPO's
    prefill and decode."""
    out = [Phase("learning step", step_peak)]
    if isinstance(trainer, GRPOTrainer):
        rollout = {k: v for k, v in step_batch.items() if k != "reference_logps"}
        if trainer.beta > 0:
            out.append(
                Phase("reference pass", _forward_peak(trainer, trainer.policy_logps, rollout))
            )
        out.extend(_rollout_phases(trainer, step_batch["inputs"].shape[0]))
    elif isinstance(trainer, DPOTrainer) and not getattr(trainer, "precompute_ref_log_probs", 0):
        pairs = {k: v for k, v in step_batch.items() if not k.startswith("reference_")}
        reference_pass = getattr(trainer, "_reference_pass", None)
        if reference_pass is not None:
            out.append(Phase("reference pass", _forward_peak(trainer, reference_pass, pairs)))
    return out


def _rollout_phases(trainer: GRPOTrainer, rows: int) -> list[Phase]:
    """The sampler's prefill and decode for ``rows`` completions, compiled on the policy's
    shapes (the bucket a rollout's ``generate`` call takes)."""
    _, model, _ = _abstract_model(trainer)
    sampler = Sampler(model, trainer.plan, print_fn=None)
    longest = max(len(p) for p in trainer.prompt_ids)
    prompts = [[0] * longest] * rows
    bucket_rows, columns, length = sampler.bucket(prompts, trainer.max_new_tokens)
    how = Sampling(temperature=trainer.temperature, top_k=trainer.top_k, top_p=trainer.top_p)
    programs = sampler.programs
    cache = programs.cache_bytes_per_device(bucket_rows, length)
    shape = f" ({bucket_rows} rows x {length} positions)"
    if not trainer.stop:  # the sampler runs prefill and the decode loop as one program
        whole = programs.whole(bucket_rows, columns, length, how)
        return [Phase("rollout (prefill and decode)", compiled_peak(whole), f", cache "
                      f"{size(cache)}{shape}")]  # fmt: skip
    prefill = programs.prefill(bucket_rows, columns, length, how)
    decode = programs.decode(bucket_rows, length, how)
    return [
        Phase("rollout prefill", compiled_peak(prefill), f", cache {size(cache)}{shape}"),
        Phase("rollout decode", compiled_peak(decode), f", cache {size(cache)}{shape}"),
    ]


def check_rollout_fits(trainer: Any, phase_list: list[Phase], budget: int | None, key: str) -> None:
    """A ``ConfigError`` when a rollout phase, beside what stays on the devices while it
    runs (the training state less the parameters its program already counts, and a
    reference copy), needs more than ``budget`` bytes a device; one line, the numbers."""
    if budget is None or not isinstance(trainer, GRPOTrainer):
        return
    state = trainer.plan.state_targets()
    params = nnx.state(nnx.merge(trainer.plan.graphdef, state)["model"], nnx.Param)

    def per_device(tree: Any) -> int:
        total = 0
        for leaf in jax.tree.leaves(tree):
            shard = leaf.sharding.shard_shape(leaf.shape)
            count = 1
            for n in shard:
                count *= n
            total += count * leaf.dtype.itemsize
        return total

    resident = per_device(state) - per_device(params)
    if trainer.beta > 0:
        resident += per_device(params)  # the reference's copy
    for phase in phase_list:
        if not phase.name.startswith("rollout"):
            continue
        need = phase.peak_bytes + resident
        if need > budget:
            raise ConfigError(
                f"{key}: the GRPO {phase.name} needs {need:,} bytes a device ({size(need)}: "
                f"its program's peak {phase.peak_bytes:,}{phase.note}, beside "
                f"{resident:,} of optimizer state{' and reference' if trainer.beta else ''}"
                f"), more than the budget of {budget:,}; give fewer prompts a rollout "
                "(config.batch_size), a smaller config.grpo.group_size or "
                "max_new_tokens, or a layout that splits more."
            )
