"""``nnx_spmd_trainer.data``: the data-facing names a user imports, from one place.

A deliberate public namespace, not a home: each name lives in the module of its
job and is re-exported here, so ``data.pad_batch`` and ``data.BATCHES_TAKEN``
(the names the docs and ``RunState.data`` use) keep working while the modules
stay small. The core imports from the homes:

- ``batches.py``: ``place_batch`` (``check_batch`` then ``transfer_batch``),
  ``rows_multiple``, ``pad_batch``;
- ``batch_errors.py``: ``BatchMismatch`` (also ``nnx_spmd_trainer.BatchMismatch``);
- ``data_position.py``: ``BATCHES_TAKEN``, the ``RunState.data`` of a Grain
  position saved under another process count.

The rest of what data.py once held is internal: ``data_position.seek`` and
``DataPosition`` (a resumed run's data), ``same_rows.py`` (processes feeding the
same rows), ``placement.InFlight`` (the bound on steps in flight).
"""

from nnx_spmd_trainer.data.batch_errors import BatchMismatch
from nnx_spmd_trainer.data.batches import (
    check_batch,
    pad_batch,
    place_batch,
    rows_multiple,
    transfer_batch,
)
from nnx_spmd_trainer.data.position import BATCHES_TAKEN

__all__ = [
    "BATCHES_TAKEN",
    "BatchMismatch",
    "check_batch",
    "pad_batch",
    "place_batch",
    "rows_multiple",
    "transfer_batch",
]
