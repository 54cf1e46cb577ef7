"""Exports a model's parameters as a plain Orbax checkpoint that loads without this library."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from nnx_spmd_trainer.data.to_host import gather_to_host
from nnx_spmd_trainer.data.written import check_export_path, written_whole

__all__ = ["check_export_path", "export_params", "written_whole"]


def _string_keys(tree: dict[Any, Any]) -> dict[str, Any]:
    """String keys (a list index ``0`` becomes ``"0"``), in the same nesting."""
    return {
        str(key): _string_keys(value) if isinstance(value, dict) else value
        for key, value in tree.items()
    }


def export_params(
    model: nnx.Module, path: str | os.PathLike[str], *, overwrite: bool = False
) -> Path:
    """Writes the ``nnx.Param`` values of ``model`` to ``path`` as a plain Orbax checkpoint.

    The checkpoint is the model's own tree of nested dicts keyed by attribute
    names, every key a string: ``model.l1.kernel`` is ``params["l1"]["kernel"]``
    and an index of a layer list is a string key, so ``model.layers[0].kernel``
    is ``params["layers"]["0"]["kernel"]``. Only ``nnx.Param`` leaves are
    written (no batch statistics, RNG state or optimizer state). Each value is
    the whole, unsharded array with its dtype. It is saved as a NumPy array, so
    the checkpoint records no mesh or devices and loads in any process, on any
    number of devices, with neither this library nor Flax::

        import orbax.checkpoint as ocp

        params = ocp.PyTreeCheckpointer().restore(path)  # nested dicts of np.ndarray

    ``path`` is made absolute and returned: Orbax refuses relative paths, on
    restore too (pass the returned path, or ``os.path.abspath(path)``).
    An existing path that is not an empty directory is refused with
    ``FileExistsError`` unless ``overwrite=True``, which replaces it.

    With several processes, every process must call this (as it must call
    ``fit``): each parameter is gathered onto every host with
    ``process_allgather`` (a collective), and every process calls Orbax's
    ``save``, which is itself collective (it syncs all processes around
    creating and committing the directory; calling it from process 0 alone
    would hang). Orbax writes NumPy arrays from process 0 only. Writing the
    sharded ``jax.Array`` values from every process instead would avoid the
    gather, but the checkpoint would then record the saving devices, and a
    plain ``restore(path)`` on other devices fails without a tree of
    ``restore_args``.
    """
    import orbax.checkpoint as ocp  # here: importing the library should not import Orbax

    params = gather_to_host(_string_keys(nnx.to_pure_dict(nnx.state(model, nnx.Param))))
    with written_whole(path, overwrite=overwrite) as partial:
        # Written whole, then renamed: a full disk leaves nothing at path (written_whole).
        # Orbax writes beside its target too (<target>.orbax-checkpoint-tmp): the target
        # is a folder inside the partial one, so its leftovers go with it.
        staged = partial / "checkpoint"
        ocp.PyTreeCheckpointer().save(staged, params, force=True)
        if jax.process_index() == 0:
            for child in staged.iterdir():
                os.replace(child, partial / child.name)
            staged.rmdir()
    return Path(path).absolute()
