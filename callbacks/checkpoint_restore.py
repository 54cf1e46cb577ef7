"""Reading one checkpoint step back: every item read into a trainer's layout and
checked before anything is applied, and a step that fails moved aside, never deleted."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grain
import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from nnx_spmd_trainer import RunState, as_position
from nnx_spmd_trainer.adapters import orbax_private
from nnx_spmd_trainer.data import BATCHES_TAKEN

from .checkpoint_checks import (
    DamagedCheckpoint,
    as_stored,
    check_data_position,
    check_same_model,
    stored_arrays,
)
from .checkpoint_items import on_devices
from .fingerprint import FingerprintRestore, mismatches

if TYPE_CHECKING:
    from nnx_spmd_trainer import Trainer


def read_meta(manager: ocp.CheckpointManager, step: int) -> dict[str, Any]:
    """The step's metadata item (JSON): its run's host state and description."""
    meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    return dict(meta["meta"])


def read_step(trainer: Trainer, manager: ocp.CheckpointManager, step: int) -> dict[str, Any]:
    """The step's items, read into this trainer's layout and checked; nothing applied."""
    path = Path(manager.directory) / str(step)
    if not path.is_dir():
        found = sorted(manager.all_steps())
        raise FileNotFoundError(
            f"there is no checkpoint step {step} at {path} (steps there: {found or 'none'})."
        )
    target = trainer.run_state(abstract=True)  # shapes and layouts: no array built
    check_same_model(path, step, target.state)
    if not orbax_private.is_committed(path):
        raise DamagedCheckpoint(
            f"checkpoint step {step} at {path} has no commit marker: it was not finished"
        )

    def unreadable(error: Exception) -> DamagedCheckpoint:
        return DamagedCheckpoint(
            f"checkpoint step {step} at {path} cannot be read ({type(error).__name__}: "
            f"{str(error)[:300]})"
        )

    try:
        meta = read_meta(manager, step)
        # The arrays of the callbacks this trainer has; others' are not read at all.
        stored = {
            name: stored_arrays(path / name)
            for key, name in meta.get("callback_arrays", {}).items()
            if key in target.callbacks
        }
    except Exception as error:  # Orbax raises many kinds; all mean "cannot be read"
        raise unreadable(error) from error
    check_data_position(path, step, meta)
    targets = {
        name: callback_targets(trainer, meta, key, target.callbacks, stored[name])
        for key, name in meta.get("callback_arrays", {}).items()
        if name in stored
    }
    try:
        saved = dict(
            manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(target.state),
                    train_metrics=ocp.args.StandardRestore(target.train_metrics),
                    fingerprints=FingerprintRestore(),
                    **{name: ocp.args.StandardRestore(item) for name, item in targets.items()},
                ),
            )
        )
    except Exception as error:  # Orbax raises many kinds; all mean "cannot be read"
        raise unreadable(error) from error
    saved["meta"] = meta
    try:
        saved["data"] = read_data_position(manager, step, meta)
    except Exception as error:  # checked above; Grain raises ValueError for a missing file
        raise unreadable(error) from error
    record = saved["fingerprints"]
    if not record["finite"]:
        raise DamagedCheckpoint(
            f"checkpoint step {step} at {path} holds non-finite values (the run diverged "
            "before it was saved)"
        )
    read = {"state": saved["state"], "train_metrics": saved["train_metrics"]}
    read.update({name: on_devices(saved[name]) for name in targets})
    expected = {
        leaf: value
        for leaf, value in record["leaves"].items()
        if leaf.split("/", 1)[0] in read  # a callback's arrays not read are not checked
    }
    bad = mismatches(expected, read, paths_version=record.get("paths", 1))
    if bad:
        raise DamagedCheckpoint(
            f"checkpoint step {step} at {path} is damaged: {len(bad)} leaves do not match "
            f"the fingerprints saved with them ({', '.join(bad[:5])})"
        )
    return saved


def callback_targets(
    trainer: Trainer,
    meta: dict[str, Any],
    key: str,
    live_states: Any,
    stored: dict[str, Any],
) -> dict[str, jax.ShapeDtypeStruct]:
    """Where each saved array of callback ``key`` is read to.

    A ``jax.Array`` goes where the callback's live state has an array or a
    ``jax.ShapeDtypeStruct`` of the same shape and dtype at the same key: into its
    sharding. With none there (the callback builds its arrays later, at
    ``on_train_begin``, say), it is replicated on the trainer's mesh. A NumPy value
    comes back as NumPy.
    """
    live = live_states.get(key)
    targets = {}
    for path, index, kind in RunState.array_stand_ins(meta["callbacks"][key]):
        shape, dtype = stored[index]
        if kind != "jax":
            targets[index] = jax.ShapeDtypeStruct(shape, dtype)  # restored as NumPy
            continue
        here = lookup(live, path)
        if (
            isinstance(here, jax.Array | jax.ShapeDtypeStruct)
            and getattr(here, "sharding", None) is not None
            and as_stored(here) == (shape, str(dtype))
        ):
            targets[index] = jax.ShapeDtypeStruct(here.shape, here.dtype, sharding=here.sharding)
            continue
        targets[index] = jax.ShapeDtypeStruct(shape, dtype, sharding=trainer.plan.replicated)
    return targets


def lookup(state: Any, path: tuple[Any, ...]) -> Any:
    """The value at ``path`` in a live callback state, or None where it has none."""
    for part in path:
        try:
            state = state[part]
        except (KeyError, IndexError, TypeError):
            return None
    return state


def read_data_position(manager: ocp.CheckpointManager, step: int, meta: dict) -> Any:
    """The step's Grain position as a value for ``RunState.data``: this process's
    ``get_state()`` as saved; ``data.BATCHES_TAKEN`` when it was saved under another
    process count (Grain's files are per process); ``None`` when none was saved."""
    if meta.get("data") != "grain":
        return None
    if int(meta.get("num_processes", 1)) != jax.process_count():
        return BATCHES_TAKEN
    # Read by Grain's own handler: a dict where the metadata recorded one (a
    # DatasetIterator's state), else the bytes of a DataLoader's (or an older step's).
    into = as_position({} if meta.get("data_position") is not None else b"")
    manager.restore(step, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(into)))
    return into.get_state()


def set_aside(
    manager: ocp.CheckpointManager,
    step: int,
    why: Exception | str,
    *,
    label: str = "damaged",
    warn: bool = True,
    print_fn: Callable[[str], None] | None = None,
) -> None:
    path = Path(manager.directory) / str(step)
    aside = path.with_name(f"{step}.{label}")
    suffix = 1
    while aside.exists():
        aside, suffix = path.with_name(f"{step}.{label}-{suffix}"), suffix + 1
    if jax.process_index() == 0:
        path.rename(aside)  # kept for inspection: nothing is deleted automatically
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"set aside checkpoint {step}")
    manager.reload()
    message = f"{why}; moved to {aside}" + (" and restoring an earlier step." if warn else ".")
    if warn:
        warnings.warn(message, RuntimeWarning, stacklevel=3)
    if print_fn is not None:
        print_fn(message)
