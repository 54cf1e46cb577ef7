"""Renamed public names keep working for one release, with a ``DeprecationWarning``.

Each rename is listed in the CHANGELOG; the warning names the new spelling and
is given once per process, so a loop reading an old name is not flooded.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

_F = TypeVar("_F", bound=Callable[..., Any])

#: The release after which a name deprecated now is gone.
REMOVED_IN = "0.2.0"
_warned: set[str] = set()


def warn_renamed(old: str, new: str) -> None:
    """Warns (once per process) that ``old`` is now spelled ``new``."""
    if old in _warned:
        return
    _warned.add(old)
    warnings.warn(
        f"{old} is deprecated and will be removed in {REMOVED_IN}; use {new}.",
        DeprecationWarning,
        stacklevel=3,
    )


def renamed_property(
    old: str,
    new: str,
    get: Callable[[Any], Any],
    set_: Callable[[Any, Any], None] | None = None,
) -> property:
    """An attribute ``old`` that reads (and writes) through ``get``/``set_``, warning
    that it is now ``new``.

    >>> class Run:
    ...     done = False
    ...     finished = renamed_property(
    ...         "Run.finished", "Run.done", lambda run: run.done)
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     Run().finished, caught[0].category.__name__
    (False, 'DeprecationWarning')
    """

    def getter(obj: Any) -> Any:
        warn_renamed(old, new)
        return get(obj)

    def setter(obj: Any, value: Any) -> None:
        warn_renamed(old, new)
        assert set_ is not None
        set_(obj, value)

    return property(
        getter,
        setter if set_ is not None else None,
        doc=f"A deprecated alias (until {REMOVED_IN}); use {new}.",
    )


def renamed_keywords(**renames: str) -> Callable[[_F], _F]:
    """A decorator: the function (or a class's ``__init__``) also takes each old keyword
    ``old="new"`` names, as ``new``, warning that it is now ``new``. Its signature shows
    only the new names.

    >>> @renamed_keywords(report="print_fn")
    ... def show(text, *, print_fn=print):
    ...     print_fn(text)
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     show("hi", report=lambda text: print(text.upper()))
    HI
    """

    def decorate(target: _F) -> _F:
        function = target.__init__ if isinstance(target, type) else target  # type: ignore[misc]
        name = target.__qualname__.removesuffix(".__init__")  # the class, as a caller writes it

        @functools.wraps(function)
        def accepting_old_names(*args: Any, **kwargs: Any) -> Any:
            for old, new in renames.items():
                if old not in kwargs:
                    continue
                if new in kwargs:
                    raise TypeError(f"{name}: give {new}= only ({old}= is its old name).")
                warn_renamed(f"{name}({old}=...)", f"{name}({new}=...)")
                kwargs[new] = kwargs.pop(old)
            return function(*args, **kwargs)

        if isinstance(target, type):
            target.__init__ = accepting_old_names  # type: ignore[misc]
            return target
        return accepting_old_names  # type: ignore[return-value]

    return decorate


#: Modules that moved in 0.2.0 (old name -> new, under the package; an old name may be
#: inside a subpackage, ``"planner.ema"``). ``import nnx_spmd_trainer.moe`` still works until
#: {REMOVED_IN}, warning once.
MOVED_MODULES: dict[str, str] = {
    "loop": "engine.loop",
    "run": "engine.run",
    "run_state": "engine.run_state",
    "run_access": "engine.run_access",
    "metric_log": "engine.metric_log",
    "predict": "engine.predict",
    "layout": "engine.plan_holder",
    "plan": "planner.plan",
    "plan_report": "planner.plan_report",
    "step": "planner.step",
    "step_compiler": "planner.step_compiler",
    "state": "planner.state",
    "auto": "planner.auto",
    "backend_defaults": "planner.backend_defaults",
    "batches": "data.batches",
    "placement": "data.placement",
    "prefetch": "data.prefetch",
    "data_position": "data.position",
    "same_rows": "data.same_rows",
    "batch_errors": "data.batch_errors",
    "pipeline": "data.grain_input",
    "attention": "nn.attention",
    "ring_attention": "nn.ring_attention",
    "moe": "nn.moe",
    "stack": "nn.stack",
    "remat": "nn.remat",
    "losses": "nn.losses",
    "export": "io.export",
    "run_lock": "io.run_lock",
    # 0.2.0's fifth floor: what wraps the optimizer in its own room; one meaning per name.
    "planner.ema": "optim.ema",
    "planner.spikes": "optim.spikes",
    "engine.layout": "engine.plan_holder",
    "strategies.host_layout": "strategies.host_axes",
    # OrbaxCheckpoint's modules, one room now (callbacks/checkpoint/; the package keeps
    # the old module's name, nnx_spmd_trainer.callbacks.checkpoint, so that one needs no entry).
    "callbacks.checkpoint_checks": "callbacks.checkpoint.checks",
    "callbacks.checkpoint_items": "callbacks.checkpoint.format",
    "callbacks.checkpoint_restore": "callbacks.checkpoint.step_reader",
    "callbacks.checkpoint_resume": "callbacks.checkpoint.resumer",
    "callbacks.checkpoint_save": "callbacks.checkpoint.save_errors",
    "callbacks.checkpoint_timer": "callbacks.checkpoint.timer",
    "callbacks.checkpoint_writer": "callbacks.checkpoint.writer",
    "callbacks.fingerprint": "callbacks.checkpoint.fingerprint",
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers an old module path with the module at its new one (the same object, so
    ``isinstance`` and monkeypatching see one module), warning that it moved."""

    def __init__(self, package: str) -> None:
        self._prefix = package + "."
        self._own_specs: dict[str, Any] = {}

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        old = fullname.removeprefix(self._prefix)
        if not fullname.startswith(self._prefix) or old not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> Any:
        new = self._prefix + MOVED_MODULES[spec.name.removeprefix(self._prefix)]
        warn_renamed(f"the module {spec.name}", new)
        module = importlib.import_module(new)
        self._own_specs[new] = module.__spec__
        return module

    def exec_module(self, module: Any) -> None:
        """The module ran when its new path was imported; the import system has just set
        its ``__spec__`` to the old path's: give it back its own (``importlib.reload``)."""
        module.__spec__ = self._own_specs[module.__name__]


def redirect_moved_modules(package: str) -> None:
    """Lets the old module paths of ``package`` import (once per process)."""
    if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder(package))
