"""A compiled train step saved beside its plan, for a later run on that hardware.

``save_step(plan, shapes, "step/")`` compiles the plan's train step for ``shapes`` (on
the devices here, or on a ``Target``'s chips that are not) and writes the executable
(jax's ``serialize_executable``) with what it was compiled by and for: jax's, jaxlib's
and the backend's versions, the devices, the mesh and the batch. On that hardware,
``load_step(plan, "step/")`` reads it back into the plan's cache of compiled steps, so
the run's first step does not compile; a record that differs from the machine or the
plan (another jax, another chip, another mesh) is refused, naming what differs.

Only load a step you saved: a serialized executable runs code on load (jax's warning).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from pathlib import Path
from typing import Any

import jax
from jax.experimental import serialize_executable

__all__ = ["RECORD", "SavedStepMismatch", "load_step", "save_step"]

#: The files a saved step is: the executable, and what it was compiled by and for.
EXECUTABLE, RECORD = "train_step.xla", "train_step.json"
#: The packages whose versions an executable depends on (those installed).
_PACKAGES = ("jax", "jaxlib", "libtpu", "jax-cuda12-plugin", "jax-cuda12-pjrt")


class SavedStepMismatch(ValueError):
    """A saved step compiled by or for something else than this machine and plan."""


def _versions() -> dict[str, str]:
    found = {}
    for name in _PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def _machine(plan: Any) -> dict[str, Any]:
    """What an executable of ``plan``'s step depends on besides its batch."""
    devices = list(plan.mesh.devices.flat)
    return {
        "versions": _versions(),
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "devices": len(devices),
        "mesh": {str(k): int(v) for k, v in plan.mesh.shape.items()},
        "strategy": repr(plan.strategy),
    }


def _shapes(batch: Any) -> dict[str, jax.ShapeDtypeStruct]:
    """A batch (a dict of arrays, as the CLI's and most are) as shapes."""
    if not isinstance(batch, dict) or not all(hasattr(x, "shape") for x in batch.values()):
        raise TypeError(
            "save_step: give the batch as a dict of arrays or jax.ShapeDtypeStruct s "
            f"({{'inputs': ..., 'targets': ...}}), not {type(batch).__name__}."
        )
    return {str(k): jax.ShapeDtypeStruct(tuple(x.shape), x.dtype) for k, x in batch.items()}


def _plan_and_step(owner: Any) -> tuple[Any, Any]:
    """``(plan, train step)`` of a ``Trainer`` (its own step: a subclass's) or a ``Plan``."""
    plan = getattr(owner, "plan", owner)
    return plan, owner.train_step


def save_step(
    owner: Any, batch: Any, directory: str | os.PathLike[str], *, norms: bool = False
) -> Path:
    """Compiles the train step of ``owner`` (a ``Trainer``, or a ``Plan``) for ``batch``
    (the global batch: a dict of arrays or ``jax.ShapeDtypeStruct`` s) and writes it into
    ``directory`` with its record. ``norms``: the step that also returns the gradient and
    update norms (what a ``Trainer`` with ``track_norms=True``, its default, runs).
    Returns the directory."""
    plan, train_step = _plan_and_step(owner)
    shapes = _shapes(batch)
    compiled = plan.lower(shapes, train_step=train_step, norms=norms).compile()
    payload, _, _ = serialize_executable.serialize(compiled)
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / EXECUTABLE).write_bytes(payload)
    record = {
        **_machine(plan),
        "batch": {k: [list(x.shape), str(x.dtype)] for k, x in shapes.items()},
        "norms": norms,
    }
    (folder / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return folder


def load_step(owner: Any, directory: str | os.PathLike[str]) -> Any:
    """The step saved in ``directory``, loaded onto the devices of ``owner`` (a
    ``Trainer``, or a ``Plan``) and put in its plan's cache of compiled steps: the
    trainer then runs it for batches of the saved shapes without compiling. Returns it
    (``jax.stages.Compiled``). A ``SavedStepMismatch`` names what differs between the
    record and this machine and plan; nothing is loaded then."""
    plan, train_step = _plan_and_step(owner)
    folder = Path(directory)
    try:
        saved = json.loads((folder / RECORD).read_text())
        payload = (folder / EXECUTABLE).read_bytes()
    except (OSError, ValueError) as error:
        raise SavedStepMismatch(
            f"{folder}: no saved step there ({error}); write one with save_step(plan, "
            "shapes, directory)."
        ) from error
    here = _machine(plan)
    differ = [
        f"{key} {saved.get(key)!r} (here {value!r})"
        for key, value in here.items()
        if saved.get(key) != value
    ]
    if differ:
        raise SavedStepMismatch(
            f"{folder}: the saved step was compiled by or for something else: "
            f"{'; '.join(differ)}. Compile it again here (save_step), or load it where it "
            "was made for."
        )
    shapes = {k: jax.ShapeDtypeStruct(tuple(v[0]), v[1]) for k, v in saved["batch"].items()}
    norms = bool(saved["norms"])
    # The argument and result structures (not serializable: CLU's metric classes are
    # local), from tracing the step again: no compile.
    jitted, args = plan.step_and_arguments(shapes, train_step=train_step, norms=norms)
    with jax.set_mesh(plan.mesh):
        traced = jitted.trace(*args)
    in_tree = jax.tree.structure((args, {}))
    out_tree = jax.tree.structure(traced.out_info)
    devices = list(plan.mesh.devices.flat)
    loaded = serialize_executable.deserialize_and_load(
        payload, in_tree, out_tree, backend=devices[0].client, execution_devices=devices
    )
    plan.put_step("train", shapes, loaded, fn=train_step, norms=norms)
    return loaded
