"""Arrays leaving the devices: gathered whole to every host, or freed.

The reverse of placement (``placement.py`` puts host batches on the devices):
``Trainer.predict``'s outputs and ``export_params``'s parameters come back through
``gather_to_host``; ``strategy="auto"``'s timings free what they placed and built with
``delete_arrays``.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils


def gather_to_host(tree: Any) -> Any:
    """Each leaf of ``tree`` whole, as a NumPy array, on every process.

    An array spread over several processes is gathered with ``process_allgather`` (a
    collective: every process must call this with the same tree), one leaf at a time,
    so the devices hold at most one whole leaf on top of what they hold already;
    anything else is copied from the devices (or taken as it is) with ``np.asarray``.

    >>> gather_to_host({"w": jax.numpy.ones(2)})
    {'w': array([1., 1.], dtype=float32)}
    """
    return jax.tree.map(_whole_on_host, tree)


def _whole_on_host(leaf: Any) -> np.ndarray:
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
    return np.asarray(jax.device_get(leaf))


def delete_arrays(tree: Any) -> None:
    """Frees the device memory of every live ``jax.Array`` in ``tree`` now, rather than
    when Python drops the last reference."""
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array) and not leaf.is_deleted():
            leaf.delete()
