"""The checkpoint format: what one Orbax step holds, under which item names, at which version.

Saving (``writer.py``) and reading back (``step_reader.py``, ``checks.py``) both build
their Orbax arguments here, so an item is named once. One step is a directory
``<tier>/<step>/`` with these items:

* ``state`` (``STATE``): the model and optimizer state, sharded, each process writing
  its own shards; with ``OrbaxCheckpoint(trainable_only=True)``, all of it but the
  model's frozen parameters (``kept_state``; ``meta[KEPT_KEY]`` is ``"trainable"``);
* ``train_metrics`` (``TRAIN_METRICS``): the on-device metric accumulators;
* ``meta`` (``META``, JSON): the run state's host part (``RunState.host()``), the
  format ``VERSION``, library versions, strategy, mesh, config (``describe``);
* ``data`` (``DATA``): a Grain iterator's position, one file per process, when the run
  reads a Grain dataset;
* ``callback_arrays_<n>`` (``callback_item(n)``): one callback's state arrays, sharded;
  ``meta["callback_arrays"]`` names the callback of each;
* ``fingerprints`` (``FINGERPRINTS``, JSON): a fingerprint per device array and whether
  the state is finite, written in Orbax's background commit (``fingerprint.py``).

``VERSION`` counts changes a reader must know of; a step records the version it was
written in, and a step of a newer version than this library reads is refused
(``check_version``), never read as damage or half understood. Steps written before the
version was recorded are version 1.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import time
from typing import TYPE_CHECKING, Any

import grain
import jax
import orbax.checkpoint as ocp
from flax import nnx

from nnx_spmd_trainer import RunState, as_position

from .fingerprint import FingerprintRestore, FingerprintSave, PendingSummary

if TYPE_CHECKING:
    from nnx_spmd_trainer import Trainer

#: The format this library writes and the newest it reads.
VERSION = 1
#: The ``meta`` key holding it.
VERSION_KEY = "format"

STATE = "state"
TRAIN_METRICS = "train_metrics"
META = "meta"
DATA = "data"
FINGERPRINTS = "fingerprints"
_CALLBACK_ARRAYS = "callback_arrays_"
#: The ``meta`` key naming the item of each callback's arrays.
_CALLBACKS_KEY = "callback_arrays"
#: The ``meta`` key saying what of the state a step holds: ``"all"`` or ``"trainable"``.
KEPT_KEY = "state_kept"


def kept_state(state: Any, trained: nnx.filterlib.Filter | None) -> Any:
    """The part of a run's state (``{"model", "optimizer"}``, arrays or restore targets)
    a step holds: all of it where ``trained`` is None; else all but the model's
    parameters that ``trained`` (the trainer's ``wrt``: ``nnx.LoRAParam``) leaves out,
    the frozen base, which a restore takes from the trainer's first state (its
    ``init_from``) again. The optimizer's state and the model's RNG state are kept."""
    if trained is None:
        return state
    frozen = nnx.All(nnx.Param, nnx.Not(trained))
    return nnx.State({**state, "model": nnx.filter_state(state["model"], nnx.Not(frozen))})


def onto_base(base: Any, kept: Any) -> Any:
    """A whole state: ``kept`` (a ``kept_state``) over ``base`` (the first state)."""
    return nnx.merge_state(base, kept)


class NewerCheckpointFormat(ValueError):
    """A step written by a newer release of this library, in a format this one cannot
    read; the message names the step, both versions and the fix."""


def callback_item(n: int) -> str:
    """The item of the ``n``-th callback (by ``state_key``) whose state holds arrays."""
    return f"{_CALLBACK_ARRAYS}{n}"


def check_version(meta: dict[str, Any], where: str) -> None:
    """Raises ``NewerCheckpointFormat`` when ``meta`` (of the step ``where`` names) was
    written in a newer format than ``VERSION``."""
    found = int(meta.get(VERSION_KEY, 1))
    if found > VERSION:
        raise NewerCheckpointFormat(
            f"{where} was written in checkpoint format {found} (by nnx-spmd-trainer "
            f"{meta.get('versions', {}).get('nnx-spmd-trainer', 'newer than this')}); this "
            f"release reads formats up to {VERSION}. Resume it with the release that wrote "
            "it, or start this run in another directory (or restore=None)."
        )


# -- saving ------------------------------------------------------------------------------------
def save_args(
    run: RunState,
    meta: dict[str, Any],
    callback_leaves: dict[str, dict[str, Any]],
    fingerprints: PendingSummary,
) -> ocp.args.Composite:
    """Every item of one step, as ``CheckpointManager.save`` takes them."""
    items: dict[str, Any] = {
        STATE: ocp.args.StandardSave(run.state),
        TRAIN_METRICS: ocp.args.StandardSave(run.train_metrics),
        META: ocp.args.JsonSave(meta),
        FINGERPRINTS: FingerprintSave(fingerprints),
    }
    for name, leaves in callback_leaves.items():
        items[name] = ocp.args.StandardSave(leaves)
    if run.data is not None:  # where the next step's batch starts, even read ahead
        items[DATA] = grain.checkpoint.CheckpointSave(as_position(run.data))
    return ocp.args.Composite(**items)


def saved_callbacks(meta: dict[str, Any]) -> dict[str, str]:
    """``{state_key: item name}`` of the callbacks whose arrays a step holds."""
    return dict(meta.get(_CALLBACKS_KEY, {}))


def callback_items(run: RunState) -> dict[str, tuple[str, dict[str, Any]]]:
    """``{item name: (state_key, {"0": array, ...})}``: one Orbax item per callback whose
    state holds arrays, so a restore reads only those of the callbacks it has."""
    arrays = run.callback_arrays()
    return {callback_item(n): (key, arrays[key]) for n, key in enumerate(sorted(arrays))}


def describe(
    trainer: Trainer,
    step: int,
    run: RunState,
    monitor: dict[str, Any],
    callbacks: dict[str, tuple[str, dict[str, Any]]],
    *,
    trainable_only: bool = False,
) -> dict[str, Any]:
    """The ``meta`` item: the run state's host part and what wrote it.

    ``monitor``: ``{logs key: (step, value)}`` of the monitored value, ``{}`` without one.
    ``callbacks``: ``callback_items(run)``, recorded as ``saved_callbacks`` reads it.
    ``trainable_only``: the step holds a ``kept_state`` without the frozen parameters."""
    host = run.host()
    return {
        **host,
        VERSION_KEY: VERSION,
        KEPT_KEY: "trainable" if trainable_only else "all",
        _CALLBACKS_KEY: {key: name for name, (key, _) in callbacks.items()},
        "step": step,
        "data": "grain" if run.data is not None else "skip",
        # Grain keeps no checksum of its file: the position is checked against this.
        "data_position": host.get("data"),
        "monitor": monitor,
        "versions": versions(),
        "strategy": repr(trainer.strategy),
        "mesh": dict(trainer.mesh.shape),
        "num_processes": jax.process_count(),
        "config": jsonable(trainer.config),
        "time": time.time(),
    }


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


def on_devices(leaves: dict[str, Any]) -> dict[str, Any]:
    """The ``jax.Array`` leaves: what the fingerprints cover of a callback's arrays (its
    NumPy values would be converted, 64-bit ones narrowed, on their way to the devices)."""
    return {index: x for index, x in leaves.items() if isinstance(x, jax.Array)}


# -- reading -----------------------------------------------------------------------------------
def meta_args() -> ocp.args.Composite:
    """The ``meta`` item alone."""
    return ocp.args.Composite(**{META: ocp.args.JsonRestore()})


def restore_args(
    state: Any, train_metrics: Any, callback_targets: dict[str, Any]
) -> ocp.args.Composite:
    """The array items and the fingerprints, each array read into its target's layout."""
    return ocp.args.Composite(
        **{
            STATE: ocp.args.StandardRestore(state),
            TRAIN_METRICS: ocp.args.StandardRestore(train_metrics),
            FINGERPRINTS: FingerprintRestore(),
            **{name: ocp.args.StandardRestore(item) for name, item in callback_targets.items()},
        }
    )


def data_args(into: Any) -> ocp.args.Composite:
    """The ``data`` item, read by Grain's own handler into ``into`` (``as_position``)."""
    return ocp.args.Composite(**{DATA: grain.checkpoint.CheckpointRestore(into)})
