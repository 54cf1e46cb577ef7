"""DataParallel: replicate the state, split the batch."""

from __future__ import annotations

import dataclasses

from nnx_spmd_trainer.strategies.base import Strategy


@dataclasses.dataclass(frozen=True, repr=False)
class DataParallel(Strategy):
    """Every device holds the whole state and a slice of the batch.

    >>> strategy = DataParallel()          # all devices on the "data" axis
    >>> strategy.mesh_axes()
    (('data', -1),)
    """

    size: int = -1
    axis: str = "data"
