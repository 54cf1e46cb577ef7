"""The layering, checked: import-linter's contracts ([tool.importlinter] in pyproject.toml)
hold on the tree, a wrong import breaks them, every folder has its place in them, and the
map in docs/architecture.md names only paths that exist."""

from __future__ import annotations

import ast
import importlib
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType

from test_api_surface import MODULES as PUBLIC_PACKAGES

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "nnx_spmd_trainer"
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")

OUTSIDE_THE_CORE = {"app", "__main__"}


def lint_imports(cwd: Path, *contracts: str) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` run where ``make test`` runs it (the repository root, or a copy)."""
    only = [arg for contract in contracts for arg in ("--contract", contract)]
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--no-logo", *only],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def contracts() -> dict[str, dict]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    return {contract["id"]: contract for contract in config["contracts"]}


def package_children() -> set[str]:
    """The package's folders and top modules, as the contracts name them."""
    folders = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    return folders | modules


def test_the_tree_keeps_every_import_contract() -> None:
    result = lint_imports(REPO)
    assert result.returncode == 0, (
        "the import contracts in pyproject.toml ([tool.importlinter]) are broken; "
        f"each line is importer -> imported (line):\n{result.stdout}\n{result.stderr}"
    )


def copy_of_the_tree(tmp_path: Path) -> Path:
    """The package, callbacks/ and pyproject.toml copied into ``tmp_path``, to break."""
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(PACKAGE, tmp_path / "nnx_spmd_trainer", ignore=ignore)
    shutil.copytree(REPO / "callbacks", tmp_path / "callbacks", ignore=ignore)
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    return tmp_path


def add_import(path: Path, line: str) -> None:
    path.write_text(path.read_text() + f"\n{line}  # wrong\n")


def test_an_engine_import_from_nn_breaks_the_contract_naming_it(tmp_path: Path) -> None:
    copy_of_the_tree(tmp_path)
    wrong = "nnx_spmd_trainer.nn.losses -> nnx_spmd_trainer.engine.loop"

    before = lint_imports(tmp_path, "nn-below-the-engine", "layers")
    assert wrong not in before.stdout, before.stdout

    losses = tmp_path / "nnx_spmd_trainer/nn/losses.py"
    add_import(losses, "from nnx_spmd_trainer.engine import loop")
    after = lint_imports(tmp_path, "nn-below-the-engine", "layers")

    assert after.returncode != 0, after.stdout
    nn_contract = contracts()["nn-below-the-engine"]["name"]
    assert re.search(re.escape(nn_contract) + r"\s+BROKEN", after.stdout), after.stdout
    # Named by both contracts: the forbidden one and the layers.
    assert after.stdout.count(wrong) >= 2, after.stdout


def test_every_folder_and_module_has_its_place_in_the_contracts() -> None:
    """A new folder must be placed on purpose: in the layers (import-linter's ``exhaustive``
    checks that), among the core that never imports app/ or callbacks/, and either public to
    callbacks or forbidden to them."""
    children = package_children()
    by_id = contracts()

    def names(modules: list[str]) -> set[str]:
        return {m.removeprefix("nnx_spmd_trainer.").removesuffix(".**") for m in modules}

    core = names(by_id["core-without-app-or-callbacks"]["source_modules"])
    assert core == children - OUTSIDE_THE_CORE

    layers = by_id["layers"]
    placed = {name.strip(" ()") for layer in layers["layers"] for name in re.split("[|:]", layer)}
    assert placed | set(layers["exhaustive_ignores"]) == children


def allowed(contract_id: str) -> set[str]:
    """The modules an allow-list contract lets its sources import: what each of its
    ``ignore_imports`` (``importer -> imported``) names on the right."""
    return {line.split("->")[1].strip() for line in contracts()[contract_id]["ignore_imports"]}


def public_modules() -> set[str]:
    """The public packages of the API snapshot and every module a public module's
    ``__all__`` names (``nnx_spmd_trainer.distributed``, then its ``agree``)."""
    public, todo = set(), ["nnx_spmd_trainer", *PUBLIC_PACKAGES]
    while todo:
        module = importlib.import_module(todo.pop())
        public.add(module.__name__)
        named = (getattr(module, name) for name in getattr(module, "__all__", ()))
        todo += [m.__name__ for m in named if isinstance(m, ModuleType)]
        todo = [name for name in todo if name not in public]
    return public


def test_callbacks_may_import_only_public_modules_and_fenced_adapters() -> None:
    """The callbacks' contract is an allow-list; each module on it is public, the renamed
    names (``deprecation``), or a fenced adapter of Orbax, Grain or tensorboardX."""
    contract = contracts()["callbacks-public-names-only"]
    assert contract["forbidden_modules"] == ["nnx_spmd_trainer"]
    assert not contract.get("allow_indirect_imports", False)  # a path in starts on the list
    adapters = {m for m in allowed("callbacks-public-names-only") if ".adapters." in m}
    assert adapters == {
        f"nnx_spmd_trainer.adapters.{name}_private" for name in ("orbax", "grain", "tensorboardx")
    }
    others = allowed("callbacks-public-names-only") - adapters - {"nnx_spmd_trainer.deprecation"}
    assert others <= public_modules(), others - public_modules()


def test_an_import_off_the_callbacks_allow_list_breaks_it_naming_the_module(
    tmp_path: Path,
) -> None:
    """A room of an allowed package, and an adapter not on the list (the old deny-list let
    both through), each named as importer -> imported."""
    copy_of_the_tree(tmp_path)
    nan = tmp_path / "callbacks" / "nan.py"
    add_import(nan, "from nnx_spmd_trainer.weights import load")
    add_import(nan, "from nnx_spmd_trainer.adapters import jax_private")

    result = lint_imports(tmp_path, "callbacks-public-names-only")

    assert result.returncode != 0, result.stdout
    name = contracts()["callbacks-public-names-only"]["name"]
    assert re.search(re.escape(name) + r"\s+BROKEN", result.stdout), result.stdout
    for wrong in ("weights.load", "adapters.jax_private"):
        assert f"callbacks.nan -> nnx_spmd_trainer.{wrong}" in result.stdout, result.stdout


def test_app_may_import_only_public_packages() -> None:
    """app/ is a user of the library: what its contract lets it import directly is the
    facade's public packages, each on the API snapshot or named by a public ``__all__``."""
    contract = contracts()["app-public-names-only"]
    assert contract["source_modules"] == ["nnx_spmd_trainer.app"]
    everything_but_app = {f"nnx_spmd_trainer.{name}" for name in package_children() - {"app"}}
    assert set(contract["forbidden_modules"]) == everything_but_app - {"nnx_spmd_trainer.__main__"}
    assert allowed("app-public-names-only") <= public_modules()


def test_a_private_app_import_breaks_its_contract_naming_the_module(tmp_path: Path) -> None:
    """A module of a public package, an adapter, and a private package: each named as
    importer -> imported."""
    copy_of_the_tree(tmp_path)
    assert lint_imports(tmp_path, "app-public-names-only").returncode == 0

    interrupts = tmp_path / "nnx_spmd_trainer/app/interrupts.py"
    add_import(interrupts, "from nnx_spmd_trainer.engine import loop")
    add_import(interrupts, "from nnx_spmd_trainer.data.tokenizer import EOS_TOKEN")
    add_import(interrupts, "from nnx_spmd_trainer.adapters import jax_private")
    result = lint_imports(tmp_path, "app-public-names-only")

    assert result.returncode != 0, result.stdout
    name = contracts()["app-public-names-only"]["name"]
    assert re.search(re.escape(name) + r"\s+BROKEN", result.stdout), result.stdout
    for wrong in ("engine.loop", "data.tokenizer", "adapters.jax_private"):
        assert f"nnx_spmd_trainer.app.interrupts -> nnx_spmd_trainer.{wrong}" in result.stdout, (
            result.stdout
        )


def imported_names(path: Path) -> set[str]:
    """Every module an ``import`` statement in ``path`` names, TYPE_CHECKING blocks included."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def test_no_core_module_names_the_installed_callbacks_package() -> None:
    """What grimp cannot see: callbacks/ is outside nnx_spmd_trainer/ on disk, so an import
    of ``nnx_spmd_trainer.callbacks`` is dropped from its graph; read the core's imports here."""
    core = [p for p in PACKAGE.rglob("*.py") if "app" not in p.relative_to(PACKAGE).parts[:1]]
    assert len(core) > 50
    named = {str(path.relative_to(REPO)): imported_names(path) for path in core}
    offending = {
        path: sorted(n for n in names if n.startswith(CALLBACKS))
        for path, names in named.items()
        if any(n.startswith(CALLBACKS) for n in names)
    }
    assert not offending, f"the core imports the callbacks: {offending}"


CALLBACKS = "nnx_spmd_trainer.callbacks"
DOC = REPO / "docs" / "architecture.md"


def test_every_path_the_architecture_doc_names_exists() -> None:
    """The map and the "to change X, open Y" table stay true as files move: each path under
    nnx_spmd_trainer/ or callbacks/ exists, and each ``name.py`` is some file's tail."""
    text = DOC.read_text()
    paths = set(re.findall(r"(?<![\w./])((?:nnx_spmd_trainer|callbacks)/[\w/.]*\w)", text))
    assert len(paths) > 20  # the map and the table name them in full
    missing = sorted(p for p in paths if not (REPO / p).exists())
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"

    files = [p.relative_to(REPO).as_posix() for p in REPO.rglob("*.py") if ".venv" not in p.parts]
    tails = set(re.findall(r"(?<![\w.])([\w/]*\w\.py)\b", text))
    unknown = sorted(t for t in tails if not any(f == t or f.endswith("/" + t) for f in files))
    assert not unknown, f"docs/architecture.md names files that do not exist: {unknown}"


# Folders whose __init__ docstring names each of its modules on a line of its own
# ("- ``name.py``: what it holds"): what a newcomer reads first. The other folders join the
# list as they are next reorganised.
FOLDERS_NAMING_EVERY_MODULE = ("data", "engine", "optim", "planner", "strategies")


def test_a_folders_docstring_names_each_of_its_modules_on_a_line() -> None:
    unnamed = {}
    for folder in FOLDERS_NAMING_EVERY_MODULE:
        init = PACKAGE / folder / "__init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        named = set(re.findall(r"^- ``(\w+\.py)``", doc, re.MULTILINE))
        modules = {p.name for p in init.parent.glob("*.py")} - {"__init__.py"}
        if modules - named:
            unnamed[folder] = sorted(modules - named)
    assert not unnamed, f"name each module on a line of the folder's __init__ docstring: {unnamed}"
