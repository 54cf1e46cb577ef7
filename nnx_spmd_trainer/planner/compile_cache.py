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

The cache is JAX's, one per process: the last ``Trainer`` built decides it for every
compile from then on, and ``"off"`` stays off for the process until a ``Trainer`` names
a directory.

>>> CacheCounts(hits=3, misses=1)
CacheCounts(hits=3, misses=1)
>>> str(CacheCounts(hits=3, misses=1))
'3 hits, 1 miss'
"""

from __future__ import annotations

import dataclasses
import os
import threading
import warnings
from pathlib import Path
from typing import Any

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache

#: The environment variable read when a ``Trainer`` is given no ``compile_cache``.
ENV_VAR = "NNX_SPMD_TRAINER_COMPILE_CACHE"
#: The setting that turns the cache off.
OFF = "off"
#: The setting that asks the next rule (the environment, JAX's configuration, the default).
AUTO = "auto"
#: The most a cache directory chosen here holds (JAX evicts the least recently used).
MAX_BYTES = 4 * 2**30

CompileCacheSetting = str | os.PathLike[str] | None

# JAX's defaults of the options set here only when they are still at them: a value the
# user chose is theirs.
_JAX_MIN_COMPILE_SECONDS = 1.0
_JAX_UNBOUNDED = -1


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
    setting or the environment that cannot be used; an unusable default directory only
    warns (the run goes on, compiling everything)."""
    choice = _chosen(setting)
    if choice == OFF:
        _update(jax_enable_compilation_cache=False)
        return None
    if choice == AUTO:
        if not _option("jax_enable_compilation_cache"):
            return None  # switched off in JAX's own configuration
        if _option("jax_compilation_cache_dir"):
            return Path(_option("jax_compilation_cache_dir"))  # the user's own
        try:
            return _turn_on(default_directory())
        except CompileCacheError as error:
            warnings.warn(f"No compilation cache: {error}", stacklevel=2)
            return None
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


def _turn_on(directory: Path) -> Path:
    """The cache on in ``directory`` (made if missing), every program cached, bounded."""
    directory = directory.expanduser().absolute()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CompileCacheError(
            f"cannot make the compilation cache directory {str(directory)!r} ({error}); "
            f"name a writable one (compile_cache=..., {ENV_VAR}) or {OFF!r}."
        ) from error
    options: dict[str, object] = {
        "jax_enable_compilation_cache": True,
        "jax_compilation_cache_dir": str(directory),
    }
    if _option("jax_persistent_cache_min_compile_time_secs") == _JAX_MIN_COMPILE_SECONDS:
        options["jax_persistent_cache_min_compile_time_secs"] = 0.0
    if _option("jax_compilation_cache_max_size") == _JAX_UNBOUNDED:
        options["jax_compilation_cache_max_size"] = MAX_BYTES
    _update(**options)
    return directory


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
