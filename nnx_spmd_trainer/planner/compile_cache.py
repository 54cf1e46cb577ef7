"""JAX's persistent compilation cache: on by default, in a user cache directory.

A rerun, a resume or a requeue of the same job compiles the same programs again. JAX
keeps compiled programs on disk when ``jax_compilation_cache_dir`` is set, keyed by the
program, its devices, the compile options, ``XLA_FLAGS`` and the versions of JAX and
XLA, so an entry is never served for another program. A ``Trainer`` turns it on when it
is built (``use_compile_cache``); where, in this order:

1. the ``Trainer``'s ``compile_cache`` (the CLI's ``--config.compile_cache``): a
   directory, or ``"off"``; ``None`` or ``"auto"`` ask the next rule;
2. the environment variable ``NNX_SPMD_TRAINER_COMPILE_CACHE``, read the same way;
3. JAX's own configuration, left as the user set it: a ``jax_compilation_cache_dir``
   already set (``JAX_COMPILATION_CACHE_DIR``, ``jax.config.update``) is used as it is,
   and ``jax_enable_compilation_cache=False`` keeps the cache off;
4. ``$XDG_CACHE_HOME/nnx_spmd_trainer/jax`` (``~/.cache/nnx_spmd_trainer/jax``).

In a directory this module chooses (rules 1, 2 and 4) every program is cached, however
quickly it compiled (JAX's own floor of one second would leave out every program of a
small CPU job), and the directory is kept under ``MAX_BYTES``, the least recently used
entries evicted first. That bound also makes JAX take a file lock (``filelock``) around
each read and write of an entry: JAX writes an entry in place, not by rename, so without
the lock a run could read an entry another run is still writing. Several processes of
one ``jax.distributed`` job share a cache safely in any case: only process 0 writes.

A directory chosen here that cannot take entries (read-only, or on a disk with less than
``MIN_FREE_BYTES`` free) turns the cache off for the run with one warning, where JAX would
warn twice per program and cache nothing; an entry left half-written (a run killed, or a
disk that filled, while JAX wrote it: an entry without the access-time file JAX writes
after it) is deleted when the cache is turned on, where JAX would fail to read it in
every run and never write it again.

The cache is JAX's, one per process: the last ``Trainer`` built decides it for every
compile from then on, and ``"off"`` stays off for the process until a ``Trainer`` names
a directory.

>>> CacheCounts(hits=3, misses=1)
CacheCounts(hits=3, misses=1)
>>> str(CacheCounts(hits=3, misses=1))
'3 hits, 1 miss'
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import sys
import threading
import uuid
import warnings
from pathlib import Path
from typing import Any

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache

__all__ = [
    "AUTO",
    "ENV_VAR",
    "MAX_BYTES",
    "OFF",
    "CacheCounts",
    "CompileCacheError",
    "CompileCacheSetting",
    "cache_counts",
    "compile_cache_directory",
    "default_directory",
    "use_compile_cache",
]

#: The environment variable read when a ``Trainer`` is given no ``compile_cache``.
ENV_VAR = "NNX_SPMD_TRAINER_COMPILE_CACHE"
#: The setting that turns the cache off.
OFF = "off"
#: The setting that asks the next rule (the environment, JAX's configuration, the default).
AUTO = "auto"
#: The most a cache directory chosen here holds (JAX evicts the least recently used).
MAX_BYTES = 4 * 2**30
#: Free bytes below which a disk is taken as full and the cache stays off for the run (the
#: default job's programs take about 1 MB; a larger model's take more).
MIN_FREE_BYTES = 64 * 2**20

CompileCacheSetting = str | os.PathLike[str] | None

# JAX's defaults of the options set here only when they are still at them: a value the
# user chose is theirs.
_JAX_MIN_COMPILE_SECONDS = 1.0
_JAX_UNBOUNDED = -1
# The names of JAX's bounded cache (jax/_src/lru_cache.py): an entry is ``<key>-cache``,
# written first, then ``<key>-atime``; both are written holding ``.lockfile``.
_ENTRY, _ATIME, _LOCKFILE = "-cache", "-atime", ".lockfile"


class CompileCacheError(ValueError):
    """A ``compile_cache`` setting that cannot be used: empty, a file, or not creatable."""


def default_directory() -> Path:
    """``$XDG_CACHE_HOME/nnx_spmd_trainer/jax``, else ``~/.cache/nnx_spmd_trainer/jax``."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "nnx_spmd_trainer" / "jax"


def use_compile_cache(setting: CompileCacheSetting = None) -> Path | None:
    """Turns JAX's persistent compilation cache on or off as ``setting`` (then the
    environment, then JAX's configuration) says; returns the directory it uses now, or
    ``None`` when it is off. Raises ``CompileCacheError`` for a directory named by the
    setting or the environment that cannot be made; an unusable default directory, or any
    directory chosen here that cannot take entries (read-only, a full disk), warns once and
    turns the cache off (the run goes on, compiling everything)."""
    choice = _chosen(setting)
    if choice == OFF:
        _update(jax_enable_compilation_cache=False)
        return None
    if choice == AUTO:
        if not _option("jax_enable_compilation_cache"):
            return None  # switched off in JAX's own configuration
        if _option("jax_compilation_cache_dir"):
            return Path(_option("jax_compilation_cache_dir"))  # the user's own
        directory = default_directory()
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            _off_for_this_run(f"{str(directory)!r} cannot be made ({error.strerror})")
            return None
        return _turn_on(directory)
    return _turn_on(Path(choice))


def compile_cache_directory() -> Path | None:
    """The directory JAX's persistent compilation cache uses now; ``None``: it is off."""
    if not _option("jax_enable_compilation_cache") or not _option("jax_compilation_cache_dir"):
        return None
    return Path(_option("jax_compilation_cache_dir"))


def _chosen(setting: CompileCacheSetting) -> str | os.PathLike[str]:
    """``OFF``, ``AUTO`` or a directory: ``setting``, else the environment's."""
    if setting is None or (isinstance(setting, str) and setting.strip().lower() == AUTO):
        setting = os.environ.get(ENV_VAR) or AUTO
        where = f"{ENV_VAR}={setting!r}"
    else:
        where = f"compile_cache={setting!r}"
    if isinstance(setting, str):
        if not setting.strip():
            raise CompileCacheError(f"{where}: give a directory, {OFF!r} or {AUTO!r}.")
        if setting.strip().lower() in (OFF, AUTO):
            return setting.strip().lower()
    path = Path(setting).expanduser()
    if path.exists() and not path.is_dir():
        raise CompileCacheError(
            f"{where} is a file, not a directory; give a directory for the compiled "
            f"programs, or {OFF!r}."
        )
    return path


def _turn_on(directory: Path) -> Path | None:
    """The cache on in ``directory`` (made if missing), every program cached, bounded, its
    half-written entries deleted; off for the run (``None``) where it cannot take entries."""
    directory = directory.expanduser().absolute()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CompileCacheError(
            f"cannot make the compilation cache directory {str(directory)!r} ({error}); "
            f"name a writable one (compile_cache=..., {ENV_VAR}) or {OFF!r}."
        ) from error
    unusable = why_unusable(directory)
    if unusable is not None:
        _off_for_this_run(f"{str(directory)!r} {unusable}")
        return None
    options: dict[str, object] = {
        "jax_enable_compilation_cache": True,
        "jax_compilation_cache_dir": str(directory),
    }
    if _option("jax_persistent_cache_min_compile_time_secs") == _JAX_MIN_COMPILE_SECONDS:
        options["jax_persistent_cache_min_compile_time_secs"] = 0.0
    if _option("jax_compilation_cache_max_size") == _JAX_UNBOUNDED:
        options["jax_compilation_cache_max_size"] = MAX_BYTES
    _update(**options)
    if _option("jax_compilation_cache_max_size") != _JAX_UNBOUNDED:  # entries have atimes
        remove_half_written(directory)
    return directory


def why_unusable(directory: Path) -> str | None:
    """Why the existing ``directory`` cannot take cache entries (``"cannot be written
    (Read-only file system)"``, ``"has 0.1 MiB free ..."``), or ``None`` when it can: a
    probe file is written, flushed to the disk and deleted, and JAX's lock file opened, as
    JAX will for every entry."""
    try:
        free = shutil.disk_usage(directory).free
    except OSError as error:
        return f"cannot be read ({error.strerror or error})"
    if free < MIN_FREE_BYTES:
        return (
            f"has {free / 2**20:.1f} MiB free (the cache wants {MIN_FREE_BYTES // 2**20} MiB "
            "or more)"
        )
    probe = directory / f".probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with open(probe, "wb") as file:
            file.write(b"\0" * 4096)
            file.flush()
            os.fsync(file.fileno())
        with open(directory / _LOCKFILE, "a"):  # JAX opens it for every read and write
            pass
    except OSError as error:
        return f"cannot be written ({error.strerror or error})"
    finally:
        with contextlib.suppress(OSError):  # a read-only file system refuses this too
            probe.unlink(missing_ok=True)
    return None


def remove_half_written(directory: Path) -> list[str]:
    """Deletes the entries of JAX's bounded cache in ``directory`` that have no access-time
    file: JAX writes it right after the entry, so an entry without one was cut short (a
    kill, a full disk) and is never read whole nor written again. Holds JAX's own lock
    (another run writing an entry holds it too), or does nothing when it is busy for
    seconds. Returns the names deleted."""
    try:
        import filelock  # JAX's bounded cache needs it; without it there is no such cache
    except ImportError:
        return []
    removed = []
    try:
        with filelock.FileLock(str(directory / _LOCKFILE), timeout=10):
            for entry in directory.glob(f"*{_ENTRY}"):
                if not entry.with_name(entry.name.removesuffix(_ENTRY) + _ATIME).exists():
                    entry.unlink(missing_ok=True)
                    removed.append(entry.name)
    except (filelock.Timeout, OSError):
        pass  # busy or unwritable: JAX's own warnings, as before, for this run's reads
    return removed


def _off_for_this_run(why: str) -> None:
    """Turns JAX's cache off for the process, saying so once: ``why`` names the directory."""
    _update(jax_enable_compilation_cache=False)
    warnings.warn(
        f"The compilation cache is off for this run: {why}; the run goes on without it. "
        f"Name a writable directory (compile_cache=..., {ENV_VAR}) or {OFF!r}.",
        stacklevel=_first_caller_outside_the_package(),
    )


def _first_caller_outside_the_package() -> int:
    """The ``stacklevel`` that makes the caller's ``warnings.warn`` name the first frame
    outside this package (the user's line that built the ``Trainer``), not the library's."""
    package = str(Path(__file__).resolve().parent.parent)
    frame, level = sys._getframe(2), 2
    while frame.f_back is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def _option(name: str) -> Any:
    """JAX's configuration option ``name`` now (its stubs do not list the cache's)."""
    return getattr(jax.config, name)


def _update(**options: object) -> None:
    """Sets JAX's ``options``; when one changed, JAX's cache is reopened at the next
    compile (it reads its directory and bound once, when first used)."""
    changed = {k: v for k, v in options.items() if _option(k) != v}
    for name, value in changed.items():
        jax.config.update(name, value)
    if changed:
        jax_cache.reset_cache()


@dataclasses.dataclass(frozen=True)
class CacheCounts:
    """Programs looked up in the persistent compilation cache: ``hits`` read from it,
    ``misses`` compiled (and written, when they pass JAX's thresholds)."""

    hits: int = 0
    misses: int = 0

    def __sub__(self, other: CacheCounts) -> CacheCounts:
        return CacheCounts(self.hits - other.hits, self.misses - other.misses)

    def __str__(self) -> str:
        def plural(n: int, word: str) -> str:
            return f"{n} {word}{'' if n == 1 else 'es' if word.endswith('s') else 's'}"

        return f"{plural(self.hits, 'hit')}, {plural(self.misses, 'miss')}"


class _Events:
    """JAX's monitoring events of the cache, counted for the whole process."""

    REQUEST = "/jax/compilation_cache/compile_requests_use_cache"
    HIT = "/jax/compilation_cache/cache_hits"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = {self.REQUEST: 0, self.HIT: 0}
        self._listening = False

    def counts(self) -> CacheCounts:
        with self._lock:
            if not self._listening:  # once per process: JAX has no way to list listeners'
                jax.monitoring.register_event_listener(self._heard)
                self._listening = True
            requests, hits = self._counts[self.REQUEST], self._counts[self.HIT]
        return CacheCounts(hits=hits, misses=requests - hits)

    def _heard(self, event: str, **_: object) -> None:
        if event in self._counts:  # compiles run on any thread (the prefetch one too)
            with self._lock:
                self._counts[event] += 1


_EVENTS = _Events()


def cache_counts() -> CacheCounts:
    """The cache's hits and misses in this process so far (counted from the first call;
    differences of two calls are what happened between them)."""
    return _EVENTS.counts()
