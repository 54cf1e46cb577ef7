"""An export written whole or not at all: the files go into a directory beside the
destination, which is renamed into place once every file is written. What the weights'
and the Orbax exports write through (``io.export``, ``weights.save_safetensors``,
``weights.write_peft_adapter``, the CLI's ``--export``)."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import jax
from jax.experimental import multihost_utils

__all__ = ["PARTIAL", "check_export_path", "write_errors", "written_whole"]

#: The suffix of the directory an export is written into before its rename.
PARTIAL = ".partial"


def check_export_path(path: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
    """The absolute export path; ``FileExistsError`` if it holds anything and not ``overwrite``."""
    path = Path(path).absolute()
    occupied = path.exists() and not (path.is_dir() and not any(path.iterdir()))
    if occupied and not overwrite:
        raise FileExistsError(
            f"{path} exists and is not an empty directory: refusing to overwrite it with an "
            "export. Remove it, pick another path, or pass overwrite=True."
        )
    return path


def write_errors() -> tuple[type[BaseException], ...]:
    """What a write that runs out of room (or is refused) raises: ``OSError``, and
    safetensors' own ``SafetensorError`` (its Rust writer's, not an ``OSError``)."""
    try:
        from safetensors import SafetensorError
    except ImportError:  # an old safetensors: its writer raised OSError
        return (OSError,)
    return (OSError, SafetensorError)


@contextlib.contextmanager
def written_whole(path: str | os.PathLike[str], *, overwrite: bool = False) -> Iterator[Path]:
    """A directory to write an export into, renamed to ``path`` once the block ends
    without an error: a full disk or a crash leaves nothing at ``path`` that looks done
    (an empty ``path`` stays empty), and the same export succeeds once there is room.

    The block writes into ``<path>.partial`` beside ``path`` (every process may write
    into it; process 0 renames it after all have finished). A write that fails (an
    ``OSError``, or safetensors' ``SafetensorError``) removes it and raises ``OSError``
    naming the cause; any other error removes it and propagates. ``path`` holding
    anything is refused (``check_export_path``) unless ``overwrite``, which replaces it
    once the new export is whole.
    """
    path = check_export_path(path, overwrite=overwrite)
    partial = path.with_name(path.name + PARTIAL)
    writer = jax.process_index() == 0
    if writer:
        shutil.rmtree(partial, ignore_errors=True)  # an earlier attempt's remains
        try:
            partial.mkdir(parents=True)
        except OSError as error:
            raise OSError(f"{partial} cannot be made: {error}") from error
    _all_processes("export directory made")
    try:
        yield partial
        _all_processes("export written")
    except write_errors() as error:
        if writer:
            shutil.rmtree(partial, ignore_errors=True)
        if isinstance(error, OSError):
            raise
        raise OSError(f"{type(error).__name__}: {error}") from error
    except BaseException:
        if writer:
            shutil.rmtree(partial, ignore_errors=True)
        raise
    if writer:
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()  # an empty directory given as --export: replaced by the export
        elif path.exists():  # overwrite: the old export goes once the new one is whole
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        os.replace(partial, path)
    _all_processes("export renamed")


def _all_processes(what: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(what)
