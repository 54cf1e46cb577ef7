"""Reading one checkpoint step back: every item read into a trainer's layout and checked
(model, commit marker, format version, data position, fingerprints, finiteness) before
anything is applied. A step that fails is ``DamagedCheckpoint``; what is done with it is
the resumer's."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import orbax.checkpoint as ocp

from nnx_spmd_trainer import RunState, as_position, path_str
from nnx_spmd_trainer.adapters import orbax_private
from nnx_spmd_trainer.data import BATCHES_TAKEN

from . import format
from .checks import (
    CheckpointOfAnotherModel,
    DamagedCheckpoint,
    as_stored,
    check_data_position,
    check_same_model,
    check_same_params,
    stored_arrays,
)
from .fingerprint import FingerprintRestore, fingerprints, mismatches

if TYPE_CHECKING:
    from nnx_spmd_trainer import Trainer


def read_meta(manager: ocp.CheckpointManager, step: int) -> dict[str, Any]:
    """The step's metadata item (JSON): its run's host state and description."""
    meta = manager.restore(step, args=format.meta_args())
    return dict(meta[format.META])


@dataclasses.dataclass(frozen=True)
class SavedStep:
    """One step read back and checked: its arrays in the reading trainer's layout."""

    state: Any
    train_metrics: Any
    meta: dict[str, Any]
    #: ``{item name: {index: array}}`` of the callbacks the trainer holds.
    callback_arrays: dict[str, dict[str, Any]]
    #: The data position as a value for ``RunState.data`` (``read_data_position``).
    data: Any


def _orbax_read(unraisable: Any) -> bool:
    """Whether an unraisable exception is a read of Orbax's (or TensorStore's) coroutine
    left in flight by a failed restore, closed when it was collected."""
    code = getattr(unraisable.object, "cr_code", None)
    filename = getattr(code, "co_filename", "")
    return "/orbax/" in filename or "/tensorstore/" in filename


class _UncollectedTasks(logging.Filter):
    """asyncio's report of a task of Orbax's reads of ``step_dir`` whose failure nobody
    collected (``Task exception was never retrieved``, a traceback each): the restore
    already failed on another read of the same step, and says so once."""

    NOTE = "Task exception was never retrieved"

    def __init__(self, step_dir: Path) -> None:
        super().__init__()
        self.step_dir = str(step_dir)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith(self.NOTE) and self.step_dir in message)


@contextlib.contextmanager
def quiet_reads(path: Path) -> Iterator[None]:
    """While the block reads the step in ``path``: ``orbax_private.quiet_failed_reads``
    (asyncio's notes of its failed reads), and the coroutines of Orbax's array reads
    still in flight when one read failed. Each reports, when collected, through
    ``sys.unraisablehook`` ("Exception ignored in: <coroutine object
    _read_array_index_and_device_put>", a traceback each, hundreds for one damaged step):
    those are dropped, and the collection is run before the block ends, so the step's
    damage is said once, by whoever catches the error. So are asyncio's reports of its
    tasks whose failure was never collected, about this step alone (for the process,
    when the read failed: they come when the collector reaches them). Every other
    unraisable exception goes to the hook before."""
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if not _orbax_read(unraisable):
            previous(unraisable)

    sys.unraisablehook = hook
    tasks = _UncollectedTasks(path)
    asyncio_logger = logging.getLogger("asyncio")
    asyncio_logger.addFilter(tasks)
    try:
        with orbax_private.quiet_failed_reads(path):
            yield
    except BaseException:
        gc.collect()  # the reads left behind, collected while they are dropped
        raise
    else:  # a read that went well leaves no task behind: the filter comes off
        asyncio_logger.removeFilter(tasks)
    finally:
        if sys.unraisablehook is hook:  # another hook set since stays
            sys.unraisablehook = previous


def _unreadable(where: str, error: Exception) -> DamagedCheckpoint:
    return DamagedCheckpoint(f"{where} cannot be read ({type(error).__name__}: {str(error)[:300]})")


def _checked_meta(manager: ocp.CheckpointManager, step: int, where: str) -> dict[str, Any]:
    """The step's metadata (``read_meta``), of a format version this library reads."""
    try:
        meta = read_meta(manager, step)
    except Exception as error:  # Orbax raises many kinds; all mean "cannot be read"
        raise _unreadable(where, error) from error
    format.check_version(meta, where)
    return meta


def read_step(
    trainer: Trainer, manager: ocp.CheckpointManager, step: int, *, trainable_only: bool = False
) -> SavedStep:
    """The step's items, read into this trainer's layout and checked; nothing applied.
    ``trainable_only``: the step holds a ``format.kept_state`` (``state`` is that part).

    Raises ``DamagedCheckpoint`` for a step that cannot be trusted, and
    ``CheckpointOfAnotherModel`` or ``format.NewerCheckpointFormat`` for one this trainer
    should not read (the user's mix-up, not damage)."""
    path = Path(manager.directory) / str(step)
    if not path.is_dir():
        found = sorted(manager.all_steps())
        raise FileNotFoundError(
            f"there is no checkpoint step {step} at {path} (steps there: {found or 'none'})."
        )
    where = f"checkpoint step {step} at {path}"
    target = trainer.run_state(abstract=True)  # shapes and layouts: no array built
    kept = format.kept_state(target.state, trainer.plan.wrt if trainable_only else None)
    check_same_model(path, step, kept)
    check_same_metrics(path, step, target.train_metrics)
    if not orbax_private.is_committed(path):
        raise DamagedCheckpoint(f"{where} has no commit marker: it was not finished")
    unreadable = functools.partial(_unreadable, where)

    with quiet_reads(path):
        meta = _checked_meta(manager, step, where)
        try:
            # The arrays of the callbacks this trainer has; others' are not read at all.
            stored = {
                name: stored_arrays(path / name)
                for key, name in format.saved_callbacks(meta).items()
                if key in target.callbacks
            }
        except Exception as error:
            raise unreadable(error) from error
        check_data_position(path, step, meta)
        targets = {
            name: callback_targets(trainer, meta, key, target.callbacks, stored[name])
            for key, name in format.saved_callbacks(meta).items()
            if name in stored
        }
        try:
            args = format.restore_args(kept, target.train_metrics, targets)
            saved = dict(manager.restore(step, args=args))
            data = read_data_position(manager, step, meta)
        except Exception as error:  # Orbax and Grain raise many kinds: "cannot be read"
            raise unreadable(error) from error
    record = saved[format.FINGERPRINTS]
    if not record["finite"]:
        raise DamagedCheckpoint(
            f"{where} holds non-finite values (the run diverged before it was saved)"
        )
    read = {format.STATE: saved[format.STATE], format.TRAIN_METRICS: saved[format.TRAIN_METRICS]}
    read.update({name: format.on_devices(saved[name]) for name in targets})
    expected = {
        leaf: value
        for leaf, value in record["leaves"].items()
        if leaf.split("/", 1)[0] in read  # a callback's arrays not read are not checked
    }
    bad = mismatches(expected, read, paths_version=record.get("paths", 1))
    if bad:
        raise DamagedCheckpoint(
            f"{where} is damaged: {len(bad)} leaves do not match the fingerprints saved "
            f"with them ({', '.join(bad[:5])})"
        )
    return SavedStep(
        state=saved[format.STATE],
        train_metrics=saved[format.TRAIN_METRICS],
        meta=meta,
        callback_arrays={name: saved[name] for name in targets},
        data=data,
    )


def check_same_metrics(path: Path, step: int, train_metrics: Any) -> None:
    """A step saved with other train metrics than the trainer's (a DPO run's read into a
    plain trainer) is ``CheckpointOfAnotherModel`` naming both, not damage: the step is
    fine, and its model can be read alone. Unreadable metadata passes (the read reports it)."""
    try:
        saved = ocp.StandardCheckpointHandler().metadata(path / format.TRAIN_METRICS)  # type: ignore[arg-type]
    except Exception:
        return
    tree = getattr(saved, "tree", saved)
    theirs = sorted({path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]})
    ours = sorted({path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(train_metrics)[0]})
    if theirs != ours:
        names = sorted({name.split("/", 1)[0] for name in theirs})
        here = sorted({name.split("/", 1)[0] for name in ours})
        raise CheckpointOfAnotherModel(
            f"checkpoint step {step} at {path} was saved with other train metrics "
            f"({', '.join(names[:6]) or 'none'}; this trainer's: {', '.join(here[:6]) or 'none'}): "
            "it is another trainer's run (DPO's, GRPO's, another task's). Restore it into a "
            "trainer of the same kind, or read its model alone: "
            "Trainer(init_from=callbacks.CheckpointWeights(step_dir, whole_model=True)), or "
            "nnx_spmd_trainer.app.load_run(workdir) for a run of nnx-spmd-train."
        )


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
    manager.restore(step, args=format.data_args(into))
    return into.get_state()


def read_params(manager: ocp.CheckpointManager, step: int, targets: Any) -> Any:
    """The model parameters of step ``step`` alone, read into ``targets`` (a state of
    ``jax.ShapeDtypeStruct`` s with shardings: the parameters of ``{"model": ...}``) and
    checked against their fingerprints; the optimizer's state and everything else of the
    step are not read. What ``CheckpointWeights`` starts a run from.

    Raises ``DamagedCheckpoint`` (unfinished, unreadable, fingerprints that disagree),
    ``format.NewerCheckpointFormat``, ``CheckpointOfAnotherModel`` (a parameter of
    ``targets`` the step lacks or holds in another shape: the first one named) and
    ``ValueError`` for a step that holds its trainable parameters alone (LoRA's
    ``trainable_only`` steps: the base is not in it)."""
    path = Path(manager.directory) / str(step)
    where = f"checkpoint step {step} at {path}"
    check_same_params(path, step, targets)
    if not orbax_private.is_committed(path):
        raise DamagedCheckpoint(f"{where} has no commit marker: it was not finished")
    unreadable = functools.partial(_unreadable, where)

    with quiet_reads(path):
        meta = _checked_meta(manager, step, where)
        if meta.get(format.KEPT_KEY, "all") != "all":
            raise ValueError(
                f"{where} holds the run's trainable parameters alone (a LoRA run's "
                "trainable_only checkpoint), not the base: start from a checkpoint of the "
                "whole model, or from its exported weights."
            )
        item = {"model": targets}
        state = ocp.args.PyTreeRestore(
            item=item,
            restore_args=ocp.checkpoint_utils.construct_restore_args(item),
            partial_restore=True,  # the parameters alone: not the optimizer's state
        )
        args = ocp.args.Composite(
            **{format.STATE: state, format.FINGERPRINTS: FingerprintRestore()}
        )
        try:
            saved = dict(manager.restore(step, args=args))
        except Exception as error:
            raise unreadable(error) from error
    read = {format.STATE: saved[format.STATE]}
    record = saved[format.FINGERPRINTS]
    actual = fingerprints(read, paths_version=record.get("paths", 1))
    bad = sorted(name for name, value in actual.items() if record["leaves"].get(name) != value)
    if bad:
        raise DamagedCheckpoint(
            f"{where} is damaged: {len(bad)} parameters do not match the fingerprints saved "
            f"with them ({', '.join(bad[:5])})"
        )
    by_name = {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(read)[0]}
    leaves, treedef = jax.tree_util.tree_flatten_with_path(targets)
    return jax.tree.unflatten(treedef, [by_name[f"state/model/{path_str(p)}"] for p, _ in leaves])
