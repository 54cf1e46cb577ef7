"""What one checkpoint step holds besides the run's own arrays: versions, the config,
and each callback's arrays as an Orbax item of its own."""

from __future__ import annotations

import functools
import importlib.metadata
import json
from typing import Any

import jax

from nnx_spmd_trainer import RunState


@functools.cache
def versions() -> dict[str, str]:
    names = ("nnx-spmd-trainer", "jax", "flax", "optax", "orbax-checkpoint", "grain")
    found = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def jsonable(config: Any) -> Any:
    if config is None:
        return None
    if hasattr(config, "to_json_best_effort"):  # ml_collections.ConfigDict
        return json.loads(config.to_json_best_effort())
    return json.loads(json.dumps(config, default=repr))


def callback_items(run: RunState) -> dict[str, tuple[str, dict[str, Any]]]:
    """``{item name: (state_key, {"0": array, ...})}``: one Orbax item per callback whose
    state holds arrays, so a restore reads only those of the callbacks it has."""
    arrays = run.callback_arrays()
    return {f"callback_arrays_{n}": (key, arrays[key]) for n, key in enumerate(sorted(arrays))}


def on_devices(leaves: dict[str, Any]) -> dict[str, Any]:
    """The ``jax.Array`` leaves: what the fingerprints cover of a callback's arrays (its
    NumPy values would be converted, 64-bit ones narrowed, on their way to the devices)."""
    return {index: x for index, x in leaves.items() if isinstance(x, jax.Array)}
