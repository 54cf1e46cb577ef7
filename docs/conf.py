"""Sphinx configuration: the API reference is built from the docstrings (autodoc + napoleon).

``make docs`` builds it with warnings as errors and nitpicky references
(``sphinx-build -W --keep-going -n``): a broken cross-reference into this
package fails the build. References into other libraries (JAX, Flax, Optax,
Orbax, NumPy, ...) are not checked: the build works offline, without intersphinx.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import sys
import typing

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
if ROOT not in sys.path:  # a source checkout without `pip install -e .` still builds
    sys.path.insert(0, ROOT)

import sphinx.util.logging  # noqa: E402

import nnx_spmd_trainer  # noqa: E402

project = "nnx_spmd_trainer"
author = "nnx_spmd_trainer contributors"
release = nnx_spmd_trainer.__version__ if hasattr(nnx_spmd_trainer, "__version__") else ""
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "myst_parser",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
html_theme = "furo"
html_title = "nnx_spmd_trainer"

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "show-inheritance": True}
autoclass_content = "both"  # the class docstring and __init__'s
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # "Attributes:" as fields: the properties are documented once, as members
napoleon_use_param = False  # "Args:" by napoleon: "steps, rounds:" entries stay whole
myst_heading_anchors = 3

# Public names are documented where users import them from (``nnx_spmd_trainer.Trainer``,
# ``nnx_spmd_trainer.callbacks.OrbaxCheckpoint``), so signatures link to those pages.
_PUBLIC: set[int] = set()
for _package in ("nnx_spmd_trainer", "nnx_spmd_trainer.callbacks", "nnx_spmd_trainer.weights"):
    _module = importlib.import_module(_package)
    for _name in _module.__all__:
        _obj = getattr(_module, _name)
        _PUBLIC.add(id(_obj))
        if isinstance(_obj, type) and _obj.__module__.startswith(_package + "."):
            _obj.__module__ = _package

nitpicky = True
_EXTERNAL = (
    "jax|jaxlib|flax|optax|orbax|numpy|np|grain|clu|ml_collections|absl|tensorboardX|tqdm"
    "|typing|typing_extensions|collections|contextlib|pathlib|os|concurrent|threading"
    "|subprocess|signal|socket|enum|dataclasses|types|io|logging|json|datetime|abc|queue"
    "|nnx|clu_metrics|ocp|P|PartitionSpec|NamedSharding|Mesh|tokenizers|lm_eval"
)
nitpick_ignore_regex = [(r"py:.*", rf"(~?)({_EXTERNAL})(\..*)?")]

# Type aliases and names as the annotations spell them (``step.LossFn``, ``sh.Rules``): the
# reference documents each once (api/types.rst); these point the signatures' links there.
ALIASES = {
    "ModelFactory": "nnx_spmd_trainer.planner.state.ModelFactory",
    "step.LossFn": "nnx_spmd_trainer.planner.step.LossFn",
    "LossFn": "nnx_spmd_trainer.planner.step.LossFn",
    "sh.Rules": "nnx_spmd_trainer.sharding.Rules",
    "Rules": "nnx_spmd_trainer.sharding.Rules",
    "auto.Auto": "nnx_spmd_trainer.Auto",
    "auto.NoLayoutFits": "nnx_spmd_trainer.NoLayoutFits",
    # nn.lora's model TypeVar, defined in lora_merge and read by weights.peft_load too
    "Model": "nnx_spmd_trainer.nn.lora.Model",
    "nnx_spmd_trainer.nn.lora_merge.Model": "nnx_spmd_trainer.nn.lora.Model",
    "nnx_spmd_trainer.weights.peft_load.Model": "nnx_spmd_trainer.nn.lora.Model",
    "Candidate": "nnx_spmd_trainer.planner.auto_choice.Candidate",
    "Lower": "nnx_spmd_trainer.planner.auto.Lower",
    "modes.AxisTypes": "nnx_spmd_trainer.strategies.axis_types.AxisTypes",
    "AxisTypes": "nnx_spmd_trainer.strategies.axis_types.AxisTypes",
    # The engine's side of a callback (engine/hooks.py): the trainer holds callbacks as
    # BaseCallback objects and is, to their dispatch, a HookHost; users meet Callback, Trainer.
    "nnx_spmd_trainer.engine.hooks.BaseCallback": "nnx_spmd_trainer.Callback",
    "nnx_spmd_trainer.engine.hooks.HookHost": "nnx_spmd_trainer.Trainer",
}


LOGGER = sphinx.util.logging.getLogger(__name__)
DOCSTRING_REQUIRED = ("module", "class", "exception", "function", "method", "property", "data")


def _resolve_alias(app, env, node, contnode):
    target = ALIASES.get(node.get("reftarget", ""))
    if node.get("refdomain") != "py" or target is None:
        return None
    py = env.domains["py"]
    return py.resolve_xref(
        env, node["refdoc"], app.builder, node["reftype"], target, node, contnode
    )


def _prose_first_line(app, what, name, obj, options, lines):
    """Keeps a prose first line whole and gives each name of ``a, b: ...`` its own field.

    Attribute and property docstrings here open with prose ("The global step: the
    optimizer's update count"), which napoleon reads as "type: description" (the types
    come from the annotations); an ``Attributes:`` entry may name several attributes
    (``strategy, mesh: the layout``), which a ``:ivar:`` field would read as type and name.
    """
    if what in ("attribute", "property", "data"):
        for k, line in enumerate(lines):
            kind, _, text = line.partition(" ")
            if kind == ":type:" and not _is_expression(text):
                del lines[k]
                if k and not lines[k - 1]:
                    del lines[k - 1]
                first = next(n for n, line in enumerate(lines) if line.strip())
                lines[first] = f"{text}: {lines[first].lstrip()}"
                break
    out: list[str] = []
    k = 0
    while k < len(lines):
        match = re.match(r"^:ivar (\w+(?:, \w+)+): ?(.*)$", lines[k])
        if match is None:
            out.append(lines[k])
            k += 1
            continue
        rest = []
        k += 1
        while k < len(lines) and lines[k].startswith(" "):
            rest.append(lines[k])
            k += 1
        for each in match.group(1).split(", "):
            out.extend([f":ivar {each}: {match.group(2)}", *rest])
    lines[:] = out


def _is_expression(text: str) -> bool:
    try:
        ast.parse(text, mode="eval")
    except SyntaxError:
        return False
    return True


def _require_docstring(app, what, name, obj, options, lines):
    """A documented object without a docstring is a warning, so ``-W`` fails the build."""
    if what in DOCSTRING_REQUIRED and not any(line.strip() for line in lines):
        LOGGER.warning("%s %s has no docstring", what, name, type="docs", subtype="docstring")


def _dataclass_factories(app, what, name, obj, options, signature, return_annotation):
    # A dataclass field's default_factory shows as ``<factory>``, which Sphinx cannot parse.
    if signature and "<factory>" in signature:
        return signature.replace("<factory>", "..."), return_annotation
    return None


def _shown_bases(base: type) -> list[type]:
    origin = typing.get_origin(base) or base  # BaseCallback[Trainer]: BaseCallback's bases
    if origin is typing.Generic:
        return []
    private = origin.__module__.startswith("nnx_spmd_trainer") and id(origin) not in _PUBLIC
    return [b for parent in origin.__bases__ for b in _shown_bases(parent)] if private else [base]


def _public_bases(app, name, obj, options, bases):
    """A private base of a public class (``OrbaxCheckpoint``'s ``CheckpointResume``, its
    restore side) shows as its own bases: "Bases:" names public classes only."""
    bases[:] = list(dict.fromkeys(b for base in bases for b in _shown_bases(base)))


def setup(app):
    app.connect("autodoc-process-bases", _public_bases)
    app.connect("missing-reference", _resolve_alias)
    app.connect("autodoc-process-docstring", _require_docstring, priority=400)
    app.connect("autodoc-process-signature", _dataclass_factories)
    app.connect("autodoc-process-docstring", _prose_first_line, priority=600)  # after napoleon
