"""The layout: the core library never imports the application (app/) or the callbacks."""

import subprocess
import sys

#: What the core must leave alone: the example application, and callbacks/ (installed here).
OUTSIDE_THE_CORE = ("nnx_spmd_trainer.app", "nnx_spmd_trainer.callbacks")

EVERY_CORE_MODULE = """
import importlib, pathlib, nnx_spmd_trainer
root = pathlib.Path(nnx_spmd_trainer.__file__).parent
for path in sorted(root.rglob("*.py")):
    parts = path.relative_to(root).with_suffix("").parts
    if parts[0] not in ("app", "__main__"):
        importlib.import_module(".".join(("nnx_spmd_trainer", *parts)).removesuffix(".__init__"))
"""


def imported_by(code: str) -> list[str]:
    """The modules in ``sys.modules`` after running ``code`` in a fresh interpreter."""
    script = f"{code}\nimport sys\nprint('\\n'.join(sorted(sys.modules)))"
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.split()


def outside_the_core(modules: list[str]) -> list[str]:
    return [m for m in modules for p in OUTSIDE_THE_CORE if m == p or m.startswith(p + ".")]


def test_importing_the_library_imports_neither_the_app_nor_the_callbacks():
    modules = imported_by("import nnx_spmd_trainer")
    assert "nnx_spmd_trainer.trainer" in modules
    assert outside_the_core(modules) == []


def test_no_core_module_imports_the_app_or_the_callbacks():
    modules = imported_by(EVERY_CORE_MODULE)
    assert {"nnx_spmd_trainer.step", "nnx_spmd_trainer.strategies.fsdp"} <= set(modules)
    assert outside_the_core(modules) == []
