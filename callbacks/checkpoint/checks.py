"""Checks on a step before it is read: the model it was written for, its data position,
and damage agreed on by every process; the errors they raise."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from nnx_spmd_trainer import path_str
from nnx_spmd_trainer.adapters import grain_private
from nnx_spmd_trainer.distributed import agree

from . import format


class DamagedCheckpoint(Exception):
    """A checkpoint step that cannot be trusted; the message names its step and path."""


class CheckpointOfAnotherModel(ValueError):
    """A checkpoint step written for another model or optimizer: the user's mix-up, not
    damage. The message names the leaves that differ and the fix."""


def as_stored(x: Any) -> tuple[tuple[int, ...], str]:
    """Shape and dtype as Orbax records them: a typed PRNG key as its uint32 key data."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.eval_shape(jax.random.key_data, x)
    return tuple(x.shape), str(x.dtype)


def _saved_leaves(path: Path) -> dict[str, tuple[tuple[int, ...], str]] | None:
    """Each leaf of the step's saved state by path: (shape, dtype); ``None`` where its
    metadata cannot be read."""
    try:
        saved = ocp.StandardCheckpointHandler().metadata(path / format.STATE)  # type: ignore[arg-type]
    except Exception:
        return None
    tree = getattr(saved, "tree", saved)
    return {
        path_str(p): (tuple(x.shape), str(x.dtype))
        for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def check_same_model(path: Path, step: int, state: Any) -> None:
    """A checkpoint of another model or optimizer is the user's mix-up, not damage:
    ``CheckpointOfAnotherModel`` names the leaves, and the step is left where it is."""
    theirs = _saved_leaves(path)
    if theirs is None:  # unreadable metadata: reading the step reports it as damage
        return
    ours = {path_str(p): as_stored(x) for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}
    only_saved = _telling_first(theirs.keys() - ours.keys())
    only_here = _telling_first(ours.keys() - theirs.keys())
    reshaped = _telling_first(k for k in ours.keys() & theirs.keys() if ours[k] != theirs[k])
    if only_saved or only_here or reshaped:
        found = [
            f"{len(keys)} {what} ({', '.join(show(k) for k in keys[:3])}"
            f"{', ...' if len(keys) > 3 else ''})"
            for keys, what, show in (
                (only_saved, "only in the checkpoint", str),
                (only_here, "only in this model", str),
                (reshaped, "of another shape", lambda k: f"{k}: saved {theirs[k]}, here {ours[k]}"),
            )
            if keys
        ]
        raise CheckpointOfAnotherModel(
            f"checkpoint step {step} at {path} was written for another model or optimizer "
            f"(leaves {'; '.join(found)}).{_hint(only_saved, only_here, reshaped)} Restore it "
            "into the model it was saved from, or use another directory (or restore=None)."
        )


def _telling_first(keys: Iterable[str]) -> list[str]:
    """Sorted with the model's weights first, then the optimizer's, then RNG counters:
    the three leaves a message names should say which model it was."""
    return sorted(keys, key=lambda k: ("rngs" in k.split("/"), k.startswith("optimizer"), k))


def _hint(only_saved: list[str], only_here: list[str], reshaped: list[str]) -> str:
    """What differs, in words: the optimizer's state alone (the model is the same: read
    it alone), or the layers stacked on one side and unrolled on the other."""
    if not any(k.startswith("model/") for k in (*only_saved, *only_here, *reshaped)):
        return (
            " The model's parameters are the same: only the optimizer's state differs "
            "(another optimizer, or other settings of it). To evaluate or sample the model, "
            "read it alone: Trainer(init_from=callbacks.CheckpointWeights(step_dir, "
            "whole_model=True)), or nnx_spmd_trainer.app.load_run(workdir) for a run of "
            "nnx-spmd-train; to resume, build the optimizer it was saved with."
        )
    model = [k for k in only_saved if k.startswith("model/")]
    return _stacking_hint(model, [k for k in only_here if k.startswith("model/")])


def _stacking_hint(only_saved: list[str], only_here: list[str]) -> str:
    """Where one side holds a layer list unrolled (``blocks/0/...``) and the other stacked
    (``blocks/...``: scanned layers), a sentence naming both forms and the fix."""

    def unnumbered(key: str) -> str:
        return "/".join(part for part in key.split("/") if not part.isdigit())

    for unrolled, stacked, saved_scanned in (
        (only_saved, only_here, False),
        (only_here, only_saved, True),
    ):
        for key in unrolled:
            if unnumbered(key) != key and unnumbered(key) in set(stacked):
                forms = [f"unrolled ({key})", f"stacked ({unnumbered(key)}, scanned layers)"]
                saved, here = forms[::-1] if saved_scanned else forms
                return (
                    f" The checkpoint holds the layers {saved}, this model {here}: build the "
                    f"model as it was saved (the shipped GPT: scan_layers={saved_scanned}, "
                    f"--config.gpt.scan_layers={saved_scanned}) to resume it."
                )
    return ""


def agree_on_damage(
    damaged: DamagedCheckpoint | None, step: int, directory: Any
) -> DamagedCheckpoint | None:
    """With several processes, damage seen by any one of them counts for all of them."""
    if jax.process_count() == 1:
        return damaged
    flags = np.array(agree.all_values("checkpoint damaged", damaged is not None))
    if damaged is None and np.any(flags):
        damaged = DamagedCheckpoint(
            f"checkpoint step {step} at {Path(directory) / str(step)} cannot be read by "
            f"processes {np.flatnonzero(flags).tolist()}"
        )
    return damaged


def stored_arrays(item: Path) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """``{name: (shape, dtype)}`` of the arrays of a flat ``StandardSave`` item, as stored."""
    saved = ocp.StandardCheckpointHandler().metadata(item)  # type: ignore[arg-type]
    tree = getattr(saved, "tree", saved)
    return {name: (tuple(x.shape), np.dtype(x.dtype)) for name, x in tree.items()}


def check_data_position(path: Path, step: int, meta: Mapping[str, Any]) -> None:
    """This process's saved Grain position in step ``step``, read and checked now, with
    the other items, so that the read inside ``fit`` finds nothing wrong with it.

    Grain writes one ``data/process_<i>-of-<n>.json`` per process, the iterator's
    ``get_state()`` as JSON, and keeps no checksum. A file that is missing or does not
    parse is damage. Where the metadata records the position itself
    (``meta["data_position"]``: process 0's, as JSON), process 0's file must equal
    it: one changed digit is then found. Without that record, a ``{"next_index": n}``
    state is checked against the batches the epoch took: ``n`` counts what the iterator consumed
    (a MapDataset's elements, an IterDataset batch's rows, the elements a filter
    dropped), at least one per batch, so an ``n`` below ``batches_in_epoch`` is damage;
    one above it cannot be told from a pipeline that counts more than batches.
    """
    if meta.get("data") != "grain" or int(meta.get("num_processes", 1)) != jax.process_count():
        return  # none saved, or not read (another process count: set from the batches taken)
    file = grain_private.position_file(path / format.DATA, jax.process_index(), jax.process_count())
    where = f"checkpoint step {step} at {path}"
    try:
        text = file.read_text()
        state = json.loads(text)
    except (OSError, ValueError) as error:  # missing, unreadable, not UTF-8, not JSON
        raise DamagedCheckpoint(
            f"{where} is damaged: its data position {file} cannot be read "
            f"({type(error).__name__}: {str(error)[:200]})"
        ) from error
    recorded = meta.get("data_position")
    if recorded is not None and jax.process_index() == 0 and state != recorded:
        raise DamagedCheckpoint(
            f"{where} is damaged: its data position {file} holds {text.strip()[:200]!r}, "
            f"not the position recorded with the step ({recorded!r:.200})"
        )
    if grain_private.is_index_state(state):
        index, taken = grain_private.next_index(state), int(meta.get("batches_in_epoch", 0))
        if not isinstance(index, int) or isinstance(index, bool) or index < taken:
            raise DamagedCheckpoint(
                f"{where} is damaged: its data position {file} says next_index {index!r}, "
                f"but the step had taken {taken} batches of its epoch"
            )


#: The names of LoRA adapters' leaves (``nn.lora``'s and Flax's ``nnx.LoRA``'s).
_ADAPTERS = ("lora_a", "lora_b")


def check_same_params(path: Path, step: int, params: Any) -> None:
    """The model parameters ``params`` (shapes) must all be in step ``step``'s state, each
    in its shape: ``CheckpointOfAnotherModel`` names the first one that is not, and both
    shapes. Leaves of the step that ``params`` lacks (the optimizer's, RNG state) are
    not asked about, but for LoRA adapters: the step's base alone is not the model its
    run trained, and is refused too."""
    theirs = _saved_leaves(path)
    if theirs is None:  # unreadable metadata: reading the step reports it as damage
        return
    where = f"checkpoint step {step} at {path}"
    for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = path_str(p)
        shape, dtype = as_stored(leaf)
        found = theirs.get(f"model/{name}")
        if found is None:
            raise CheckpointOfAnotherModel(
                f"{where} holds no model parameter {name} (this model's is {shape} {dtype}): "
                "it was written for another model."
            )
        if found[0] != shape:
            raise CheckpointOfAnotherModel(
                f"{where} holds model parameter {name} of shape {found[0]}, this model's is "
                f"{shape}: it was written for another model."
            )
    ours = {f"model/{path_str(p)}" for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
    adapters = sorted(
        name
        for name in theirs
        if name.startswith("model/") and name.rsplit("/", 1)[-1] in _ADAPTERS and name not in ours
    )
    if adapters:  # taking the base alone would drop what the run learned
        raise CheckpointOfAnotherModel(
            f"{where} holds LoRA adapters ({adapters[0].removeprefix('model/')}, ...) over its "
            "base, which this model would not take over (a new run's adapters start afresh): "
            "start from a run that trained the whole model, or merge the adapters into the "
            "base weights first."
        )
