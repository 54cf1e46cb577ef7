"""The layout: the core library never imports the application (app/) or the callbacks."""

import subprocess
import sys

#: What the core must leave alone: the example application, and callbacks/ (installed here).
OUTSIDE_THE_CORE = ("nnx_spmd_trainer.app", "nnx_spmd_trainer.callbacks")

# One fresh interpreter for both questions (each one imports JAX): the modules loaded by
# ``import nnx_spmd_trainer`` alone, printed before the rest of the core is imported.
SCRIPT = """
import importlib, pathlib, sys
import nnx_spmd_trainer
print("library:", *sorted(sys.modules))
root = pathlib.Path(nnx_spmd_trainer.__file__).parent
for path in sorted(root.rglob("*.py")):
    parts = path.relative_to(root).with_suffix("").parts
    if parts[0] not in ("app", "__main__"):
        importlib.import_module(".".join(("nnx_spmd_trainer", *parts)).removesuffix(".__init__"))
print("every core module:", *sorted(sys.modules))
"""


def imported() -> tuple[list[str], list[str]]:
    """``sys.modules`` in a fresh interpreter after ``import nnx_spmd_trainer``, and after
    importing every core module too."""
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    (library,) = [line for line in lines if line.startswith("library: ")]
    (every,) = [line for line in lines if line.startswith("every core module: ")]
    return library.split()[1:], every.split()[3:]


def outside_the_core(modules: list[str]) -> list[str]:
    return [m for m in modules for p in OUTSIDE_THE_CORE if m == p or m.startswith(p + ".")]


def test_neither_the_library_nor_any_core_module_imports_the_app_or_the_callbacks():
    library, every_core_module = imported()
    assert "nnx_spmd_trainer.trainer" in library
    assert outside_the_core(library) == []
    core = {"nnx_spmd_trainer.planner.step", "nnx_spmd_trainer.strategies.fsdp"}
    assert core <= set(every_core_module)
    assert outside_the_core(every_core_module) == []
