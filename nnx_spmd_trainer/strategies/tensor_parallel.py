"""TensorParallel: shard layers along their annotations; batch replicated on this axis."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from nnx_spmd_trainer.strategies.axis import AxisStrategy


@dataclasses.dataclass(frozen=True, repr=False)
class TensorParallel(AxisStrategy):
    """Model (tensor) parallelism over the "model" axis.

    Leaves annotated with ``"model"`` (or a logical name mapped to it:
    ``mlp``, ``hidden``, ``heads``, ``vocab``) are split; unannotated leaves
    stay replicated. Every device on this axis sees the same batch.

    >>> dict(TensorParallel(2).logical_rules())["mlp"]
    'model'
    """

    usual_axis: ClassVar[str] = "model"
    shards_batch: ClassVar[bool] = False
    logical_axes: ClassVar[tuple[str, ...]] = ("mlp", "hidden", "heads", "vocab")

    axis: str = usual_axis
