"""DataParallel: replicate the state, split the batch."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from nnx_spmd_trainer.strategies.axis import AxisStrategy


@dataclasses.dataclass(frozen=True, repr=False)
class DataParallel(AxisStrategy):
    """Every device holds the whole state and a slice of the batch.

    >>> strategy = DataParallel()          # all devices on the "data" axis
    >>> strategy.mesh_axes()
    (('data', -1),)
    """

    usual_axis: ClassVar[str] = "data"
    axis: str = usual_axis
