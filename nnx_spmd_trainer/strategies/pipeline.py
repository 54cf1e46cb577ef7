"""PipelineParallel: a stack's layers split over a stage axis, the batch streamed through."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from typing import Any, ClassVar

import jax
from flax import nnx
from jax.sharding import Mesh

from nnx_spmd_trainer import sharding as sh
from nnx_spmd_trainer.nn import stack
from nnx_spmd_trainer.strategies import axis_types as modes
from nnx_spmd_trainer.strategies.base import Axes, Strategy, is_variable

SCHEDULES = ("gpipe",)


@dataclasses.dataclass(frozen=True, repr=False)
class PipelineParallel(Strategy):
    """Pipeline parallelism: the stacked blocks' layers split over ``stages`` devices.

    - Parameters: a stack's arrays (``stack.stacked``; the shipped GPT's
      ``scan_layers=True``) are split along their ``LAYERS`` dimension over mesh
      axis ``axis``, each stage holding ``layers / stages`` consecutive layers,
      their gradients and optimizer moments too; everything else (embeddings,
      head) is laid out by the other members of a ``Hybrid`` and replicated
      along this axis.
    - The step (``trace_context``): ``stack.run`` runs the GPipe schedule
      (``stack.gpipe``): the batch cut into ``microbatches`` streamed through the
      stages, activations shifted between neighbouring stages by
      collective-permutes, the backward pass from ``jax.grad``. The step stays
      one program over global arrays, so results equal one device's. The idle
      share of a step (the bubble) is ``(S-1)/(M+S-1)`` for ``S`` stages and
      ``M`` microbatches: give ``microbatches`` several times ``stages``.
    - Batch: not split along this axis; every stage sees the same rows, and
      processes holding different stages of the same rows feed the same rows.

    Use it when the model is too deep for one device's memory and FSDP's
    per-layer all-gathers cost more than the bubble (slow links between
    devices): it moves activations, not weights.

    Errors naming the fix: layers not divisible by stages, a batch not
    divisible into microbatches, fewer microbatches than stages, a model whose
    step ran no stack, blocks that write state (dropout active) while pipelined.

    >>> PipelineParallel(4).mesh_axes(), PipelineParallel(4).batch_axes()
    ((('stage', 4),), ())
    >>> PipelineParallel(4, microbatches=8)
    PipelineParallel(4, microbatches=8)

    Attributes:
      stages: devices along the stage axis; -1 means "all left".
      microbatches: pieces each batch (each ``grad_accum_steps`` microbatch) is cut
        into; default: ``stages``.
      axis: the mesh axis name.
      schedule: ``"gpipe"`` (the only one so far).
      rules: extra logical-axis rules, merged over the strategy's defaults.
      axis_types: ``"auto"`` (default) or ``"explicit"`` (``strategies.axis_types``).
    """

    usual_axis: ClassVar[str] = "stage"

    stages: int = -1
    microbatches: int | None = None
    axis: str = usual_axis
    schedule: str = "gpipe"
    rules: sh.Rules = dataclasses.field(default=(), kw_only=True)
    axis_types: modes.AxisTypes = dataclasses.field(default="auto", kw_only=True)

    def __post_init__(self) -> None:
        modes.checked(self.axis_types, type(self).__name__)
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"PipelineParallel(schedule={self.schedule!r}): known schedules are "
                f"{', '.join(map(repr, SCHEDULES))}."
            )
        if self.stages > 0:
            self.microbatches_for(self.stages)  # fewer than the stages: refused now

    def microbatches_for(self, stages: int) -> int:
        """The microbatches on a mesh of ``stages`` stages; fewer than the stages is an error."""
        micro = stages if self.microbatches is None else self.microbatches
        if micro < stages:
            raise ValueError(
                f"{self!r}: {micro} microbatches for {stages} stages leave a stage idle "
                f"all step. Give microbatches >= {stages} (PipelineParallel(stages, "
                f"microbatches={2 * stages}) halves the bubble again)."
            )
        return micro

    def bubble(self, stages: int) -> float:
        """The share of a step each stage idles: ``(S-1)/(M+S-1)`` (GPipe).

        >>> PipelineParallel(4, microbatches=8).bubble(4)
        0.2727272727272727
        """
        return (stages - 1) / (self.microbatches_for(stages) + stages - 1)

    # -- composition ------------------------------------------------------------
    def mesh_axes(self) -> Axes:
        return ((self.axis, self.stages),)

    def batch_axes(self) -> tuple[str, ...]:
        return ()  # every stage runs the same rows

    def axis_roles(self) -> dict[str, str]:
        return {self.axis: self.usual_axis}

    def logical_rules(self) -> sh.Rules:
        user = dict(sh.merge_rules(self.rules))
        own = [(n, self.axis) for n in (sh.LAYERS, self.usual_axis) if n not in user]
        return sh.merge_rules(user.items(), own, ((n, None) for n in sh.LOGICAL_AXES))

    # -- question 1: a stack that does not split into the stages, said so ---------------
    def state_shardings(
        self, abstract_state: nnx.State, mesh: Mesh, proposed: nnx.State | None = None
    ) -> nnx.State:
        if proposed is None:
            proposed = self.annotated_shardings(abstract_state, mesh, unresolved=True)
        stages = mesh.shape.get(self.axis, 1)

        def one(path: Any, variable: nnx.Variable[Any], sharding: Any) -> Any:
            if not isinstance(sharding, sh.Unresolved):
                return sharding
            shape: tuple[int, ...] = tuple(getattr(variable.get_value(), "shape", ()))
            annotation = variable.get_metadata().get("out_sharding")
            named = sh.annotation_entries(annotation, shape=shape, mesh={})
            if named and named[0] == sh.LAYERS:
                stack.check_stages(shape[0], stages)
            raise sharding.error

        return jax.tree_util.tree_map_with_path(one, abstract_state, proposed, is_leaf=is_variable)

    # -- question 5: the stacks run pipelined ------------------------------------------
    @contextlib.contextmanager
    def trace_context(self, mesh: Mesh) -> Iterator[None]:
        """``stack.run`` runs the GPipe schedule over this axis, inside
        ``Strategy.trace_context``'s; a traced step that ran no stack is an error."""
        stages = mesh.shape[self.axis]
        pipeline = stack.GPipeSchedule(stages, self.microbatches_for(stages), self.axis, mesh)
        with super().trace_context(mesh), stack.pipelined(pipeline) as ran:
            yield
        if not ran():
            raise ValueError(
                f"{self!r}: the step ran no stacked blocks, so there is nothing to split "
                "into stages. Hold the model's blocks as one stack and run it with "
                "nnx_spmd_trainer.nn.stack (blocks = stack.stacked(Block, num_layers, rngs); "
                "x = stack.run(blocks, x)): the shipped GPT does with scan_layers=True. "
                "Or use another strategy (FSDP, TensorParallel)."
            )

    def __repr__(self) -> str:
        args = [] if self.stages == -1 else [repr(self.stages)]
        for field in dataclasses.fields(self)[1:]:
            value = getattr(self, field.name)
            if value != field.default and field.default is not dataclasses.MISSING:
                args.append(f"{field.name}={value!r}")
            elif field.name == "rules" and value:
                args.append(f"rules={value!r}")
        return f"PipelineParallel({', '.join(args)})"


def pipeline_of(strategy: Strategy) -> PipelineParallel | None:
    """The ``PipelineParallel`` in ``strategy`` (itself or a ``Hybrid``'s member), else None."""
    if isinstance(strategy, PipelineParallel):
        return strategy
    for member in getattr(strategy, "members", ()):
        found = pipeline_of(member)
        if found is not None:
            return found
    return None


def report_line(strategy: Strategy, mesh: Mesh, targets: Any) -> str:
    """What ``Plan.report`` says of a pipeline: stages, layers per stage, microbatches,
    the bubble and the stacked state's bytes per device; ``""`` without one.

    ``targets``: the state as ``jax.ShapeDtypeStruct`` s with shardings (``Plan.state_targets``).
    """
    member = pipeline_of(strategy)
    if member is None or member.axis not in mesh.shape:
        return ""
    stages = mesh.shape[member.axis]
    layers, held = 0, 0
    for leaf in jax.tree.leaves(targets):
        spec = leaf.sharding.spec
        if leaf.ndim and member.axis in sh.dimension_axes(spec, leaf.ndim)[0]:
            layers = leaf.shape[0]
            local = sh.shard_shape(leaf.shape, spec, dict(mesh.shape))
            held += math.prod(local) * leaf.dtype.itemsize
    micro = member.microbatches_for(stages)
    return (
        f"pipeline: {stages} stages x {layers // stages} of {layers} layers, {micro} "
        f"microbatches, bubble (S-1)/(M+S-1) = {member.bubble(stages):.1%}; stacked state "
        f"{held} bytes per device"
    )
