"""Trainer.predict's loop: the model's outputs batch by batch, padding trimmed."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np

from nnx_spmd_trainer.data.placement import Placement
from nnx_spmd_trainer.data.to_host import gather_to_host


def model_inputs(batch: Any) -> Any:
    """What the default ``predict_fn`` calls the model on: ``batch["x"]`` for a dict
    batch (the examples' convention), the batch itself otherwise."""
    if not isinstance(batch, Mapping):
        return batch
    if "x" not in batch:
        raise TypeError(
            f"predict: the default predict_fn calls model(batch['x']), and this batch has "
            f"the keys {sorted(batch)}; give Trainer(..., predict_fn=lambda model, batch: "
            "model(batch[...])) or override Trainer.predict_fn."
        )
    return batch["x"]


def _real_rows(placement: Placement, rows: int, padded_rows: int) -> np.ndarray:
    """The global indices of the rows every process fed before padding (each process
    pads its own rows, so its padding sits at the end of its block)."""
    real = {"real": np.arange(padded_rows) < rows}
    return np.flatnonzero(gather_to_host(placement.place(real))["real"])


def predict_batches(
    data: Iterable[Any],
    placement: Placement,
    run: Callable[[Any], Any],
    *,
    to_numpy: bool,
) -> list[Any]:
    """Each batch of ``data`` placed (padded where its rows do not split), run through
    the compiled forward program (``run(batch)``), its padding rows dropped."""
    outputs = []
    for host_batch in data:
        padded = placement.eval_batch(host_batch)
        batch = placement.place(padded)
        out = run(batch)
        if padded is not host_batch:  # rows that split need no trimming
            rows = len(jax.tree.leaves(host_batch)[0])
            keep = _real_rows(placement, rows, len(padded["mask"]))
            out = jax.tree.map(lambda x, keep=keep: x[keep], out)
        outputs.append(gather_to_host(out) if to_numpy else out)
    return outputs
