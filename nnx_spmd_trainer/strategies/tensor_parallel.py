"""TensorParallel: shard layers along their annotations; batch replicated on this axis."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

from jax.sharding import PartitionSpec as P

from nnx_spmd_trainer import sharding as sh
from nnx_spmd_trainer.strategies.axis import AxisStrategy


@dataclasses.dataclass(frozen=True, repr=False)
class TensorParallel(AxisStrategy):
    """Model (tensor) parallelism over the "model" axis.

    Leaves annotated with ``"model"`` (or a logical name mapped to it:
    ``mlp``, ``hidden``, ``heads``, ``vocab``) are split. A matrix of at least
    ``min_size`` elements that nothing splits (no annotation, or one of only
    ``None`` s, as ``FSDP``'s fallback reads it; no earlier member of a ``Hybrid``)
    is split over this axis along its last
    dimension the axis divides: an ``nnx.Embed`` table the model leaves
    unannotated (the JAX AI Stack miniGPT's) gets its features split, the layout
    XLA gives its update under ``nnx.jit``. Kept replicated, every device updated
    the whole table and its optimizer moments each step: 1.63x the tutorial's own
    step time (``benchmarks/results/minigpt_overhead.md``). Vectors (biases, norm
    scales) and smaller leaves stay replicated; so does everything unannotated
    under ``axis_types="explicit"``, where the model's types are the layout.
    ``min_size=2**63`` keeps every unannotated leaf replicated. Every device on
    this axis sees the same batch.

    >>> dict(TensorParallel(2).logical_rules())["mlp"]
    'model'
    >>> TensorParallel(2).refine_spec(P(), (50304, 32), {"model": 2})
    P(None, 'model')
    >>> TensorParallel(2).refine_spec(P(), (32,), {"model": 2})
    P()
    """

    usual_axis: ClassVar[str] = "model"
    shards_batch: ClassVar[bool] = False
    logical_axes: ClassVar[tuple[str, ...]] = ("mlp", "hidden", "heads", "vocab")

    axis: str = usual_axis
    #: Matrices smaller than this (in elements) that nothing splits stay replicated.
    min_size: int = dataclasses.field(default=1024, kw_only=True)

    def refine_spec(self, spec: P, shape: tuple[int, ...], mesh: dict[str, int]) -> P:
        if self.axis_types == "explicit" or mesh.get(self.axis, 1) < 2:
            return spec  # explicit: the model's declared types are the layout (as FSDP's)
        if len(shape) < 2 or math.prod(shape) < self.min_size or sh.spec_axes(spec):
            return spec  # a vector, a small leaf, or one a layout already splits
        return sh.shard_last_dim(spec, shape, self.axis, mesh[self.axis])
