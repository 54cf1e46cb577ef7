"""The example application on top of the library: a user of ``nnx_spmd_trainer`` like any other.

``cli`` (the ``nnx-spmd-train`` command), ``tasks`` (what a config builds),
``models`` (GPT, MLP, CNN) and ``datasets`` (pydoc text, synthetic data). The
core never imports this package; import its modules by name.

Its public names: ``load_run`` (``loader``), the model, tokenizer and layout of any
run of ``nnx-spmd-train`` from its workdir, with a checkpoint's parameters, and the
``LoadedRun`` it returns. Imported when first asked for: importing a module of this
package (``app.models``) does not build the whole application.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nnx_spmd_trainer.app.loader import LoadedRun, load_run

__all__ = ["LoadedRun", "load_run"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("nnx_spmd_trainer.app.loader"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
