"""FSDP: shard parameters, gradients and optimizer state; split the batch."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

from jax.sharding import PartitionSpec as P

from nnx_spmd_trainer import sharding as sh
from nnx_spmd_trainer.strategies.axis import AxisStrategy


@dataclasses.dataclass(frozen=True, repr=False)
class FSDP(AxisStrategy):
    """Fully sharded data parallel over one mesh axis.

    Annotated leaves keep their layout; any leaf of at least ``min_size``
    elements that does not use the fsdp axis yet is also split along its
    largest dimension the axis divides, so nothing large stays replicated.

    With ``axis_types="explicit"`` the model's code states its parameters'
    shardings and computes with them as types, so FSDP shards only what the
    model declares on its axis (as the JAX training cookbook declares
    ``P("fsdp", None)`` on its kernels) and splits the batch: sharding another
    leaf would change the types the model's code computes with, and a
    contraction it wrote unambiguous could become illegal.

    >>> FSDP(4, min_size=1).refine_spec(P(), (16, 8), {"fsdp": 4})
    P('fsdp',)
    >>> FSDP(4, min_size=1, axis_types="explicit").refine_spec(P(), (16, 8), {"fsdp": 4})
    P()
    """

    usual_axis: ClassVar[str] = "fsdp"
    logical_axes: ClassVar[tuple[str, ...]] = ("embed",)

    axis: str = usual_axis
    #: Unannotated leaves smaller than this (in elements) stay replicated.
    min_size: int = dataclasses.field(default=1024, kw_only=True)

    def refine_spec(self, spec: P, shape: tuple[int, ...], mesh: dict[str, int]) -> P:
        if self.axis_types == "explicit":
            return spec  # the model's declared types are the layout (see above)
        if self.axis not in mesh or math.prod(shape) < self.min_size:
            return spec
        return sh.shard_largest_dim(spec, shape, self.axis, mesh[self.axis])
