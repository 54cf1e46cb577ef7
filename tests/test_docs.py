"""The API reference builds with warnings as errors and names every public name; doctests run.

The reference is built as ``make docs`` builds it (``sphinx-build -W --keep-going -n``);
a tiny project with the same ``conf.py`` shows that a broken cross-reference and a
missing docstring fail that build.
"""

import doctest
import importlib
import inspect
import os
import pkgutil
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

import nnx_spmd_trainer
import nnx_spmd_trainer.callbacks as callbacks  # type: ignore[import-not-found]

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def sphinx_build(source: Path, out: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-b", "html"]
    return subprocess.run(
        [*command, str(source), str(out)], capture_output=True, text=True, timeout=300
    )


def inventory(html: Path) -> dict[str, str]:
    """``objects.inv``: object name -> ``domain:role`` (format: 4 header lines, then zlib)."""
    raw = (html / "objects.inv").read_bytes()
    header_end = 0
    for _ in range(4):
        header_end = raw.index(b"\n", header_end) + 1
    names = {}
    for line in zlib.decompress(raw[header_end:]).decode().splitlines():
        name, role = line.split(" ", 2)[:2]
        names[name] = role
    return names


@pytest.mark.slow
def test_the_reference_builds_and_names_every_public_name(tmp_path: Path) -> None:
    result = sphinx_build(DOCS, tmp_path / "html")
    assert result.returncode == 0, result.stdout + result.stderr
    names = inventory(tmp_path / "html")
    # A public module (nnx_spmd_trainer.moe, ...) is documented under its home's name.
    documented_as = {
        n: getattr(getattr(nnx_spmd_trainer, n), "__name__", None)
        if inspect.ismodule(getattr(nnx_spmd_trainer, n))
        else f"nnx_spmd_trainer.{n}"
        for n in nnx_spmd_trainer.__all__
    }
    missing = [n for n, as_ in documented_as.items() if as_ not in names]
    assert not missing, f"not in the reference: {missing}"
    for name in callbacks.__all__:
        here = f"nnx_spmd_trainer.callbacks.{name}"
        # Callback and History are the core's, re-exported: documented once, under the core.
        core = getattr(nnx_spmd_trainer, name, None) is getattr(callbacks, name)
        assert here in names or (core and f"nnx_spmd_trainer.{name}" in names), name
    for module in ["nnx_spmd_trainer.strategies", "nnx_spmd_trainer.distributed"]:
        assert names.get(module) == "py:module", module
    assert "nnx_spmd_trainer.distributed.initialize" in names
    genindex = (tmp_path / "html" / "genindex.html").read_text()
    assert all(name in genindex for name in nnx_spmd_trainer.__all__)


def tiny_project(tmp_path: Path, page: str) -> Path:
    """A docs folder with the reference's own ``conf.py`` and one page."""
    source = tmp_path / "docs"
    source.mkdir(parents=True)
    shutil.copy(DOCS / "conf.py", source / "conf.py")
    (source / "index.rst").write_text("Tiny\n====\n\n" + page)
    return source


def test_a_broken_cross_reference_and_a_missing_docstring_fail_the_build(tmp_path: Path) -> None:
    """One clean build, then the same page with both faults added: two builds, not three.

    Each sphinx process imports the package (``conf.py`` does), so each build costs a
    JAX import. Under ``-W --keep-going`` every warning is reported and any one of them
    fails the build, so each fault's own message in the failed build's output shows
    that fault alone fails it; the clean build shows the rest of the page does not.
    """
    module = tmp_path / "undocumented_module.py"
    module.write_text(
        '"""A module."""\n\n\ndef documented():\n    """Yes."""\n\n\ndef bare():\n    pass\n'
    )
    page = ".. autofunction:: undocumented_module.documented\n\n"
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q"]
    good = subprocess.run(
        [*command, str(tiny_project(tmp_path / "good", page)), str(tmp_path / "good" / "html")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert good.returncode == 0, good.stderr
    page += ".. autofunction:: undocumented_module.bare\n\n"
    page += "See :py:func:`nnx_spmd_trainer.no_such_function` and :class:`nnx_spmd_trainer.Plan`.\n"
    bad = subprocess.run(
        [*command, str(tiny_project(tmp_path / "bad", page)), str(tmp_path / "bad" / "html")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert bad.returncode != 0
    assert "undocumented_module.bare has no docstring" in bad.stderr
    assert "nnx_spmd_trainer.no_such_function" in bad.stderr
    assert "reference target not found" in bad.stderr


def package_modules() -> list[str]:
    names = []
    for package in (nnx_spmd_trainer, callbacks):
        names.append(package.__name__)
        prefix = package.__name__ + "."
        names += [m.name for m in pkgutil.walk_packages(package.__path__, prefix)]
    return sorted(n for n in set(names) if not n.endswith("__main__"))


SLOW_DOCTESTS = {"nnx_spmd_trainer.app.models.gpt", "nnx_spmd_trainer.app.models.mlp"}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.slow) if n in SLOW_DOCTESTS else n
        for n in package_modules()
    ],
)
def test_docstring_examples_run(name: str) -> None:
    """Every ``>>>`` example in the package's docstrings runs and prints what it shows."""
    module = importlib.import_module(name)
    results = doctest.testmod(module, verbose=False, report=True)
    assert results.failed == 0, f"{results.failed} of {results.attempted} examples failed"
