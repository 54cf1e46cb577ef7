"""Each module that moved into a role folder in 0.2.0 still imports from its 0.1 path, as
the same module object, warning once that it moved (``deprecation.MOVED_MODULES``)."""

from __future__ import annotations

import json
import subprocess
import sys

from nnx_spmd_trainer.deprecation import MOVED_MODULES

# A fresh interpreter: the warning is once per process, and this one may have seen it.
_PROBE = """
import importlib, json, sys, warnings
from nnx_spmd_trainer.deprecation import MOVED_MODULES
out = {}
for old, new in MOVED_MODULES.items():
    with warnings.catch_warnings(record=True) as first:
        warnings.simplefilter("always")
        module = importlib.import_module("nnx_spmd_trainer." + old)
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        importlib.import_module("nnx_spmd_trainer." + old)
    out[old] = {
        "same": module is importlib.import_module("nnx_spmd_trainer." + new),
        "spec": module.__spec__.name,  # its own: importlib.reload(module) reloads it
        "first": [f"{w.category.__name__}: {w.message}" for w in first],
        "again": len(again),
        "names": sorted(n for n in vars(module) if not n.startswith("_"))[:3],
    }
print(json.dumps(out))
"""


def test_every_old_module_path_imports_the_new_module_and_warns_once():
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True, timeout=300
    )
    seen = json.loads(done.stdout.splitlines()[-1])
    assert set(seen) == set(MOVED_MODULES)
    for old, new in MOVED_MODULES.items():
        result = seen[old]
        assert result["same"], old
        assert result["names"], f"{old} imported an empty module"
        assert result["spec"] == f"nnx_spmd_trainer.{new}", old
        assert result["first"] == [
            f"DeprecationWarning: the module nnx_spmd_trainer.{old} is deprecated and will "
            f"be removed in 0.2.0; use nnx_spmd_trainer.{new}."
        ], old
        assert result["again"] == 0, f"{old} warned twice"


def test_an_unknown_module_is_still_an_import_error():
    done = subprocess.run(
        [sys.executable, "-c", "import nnx_spmd_trainer.no_such_module"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1
    assert "ModuleNotFoundError: No module named 'nnx_spmd_trainer.no_such_module'" in done.stderr


def test_the_pipeline_schedule_answers_to_its_old_name_with_a_warning():
    """``stack.Pipeline`` is ``stack.GPipeSchedule`` now: "pipeline" alone names the Grain
    input (``grain_pipeline``, ``data.packed_pipeline``), never PipelineParallel's schedule."""
    done = subprocess.run(
        [
            sys.executable,
            "-W",
            "always",
            "-c",
            "from nnx_spmd_trainer import stack; print(stack.Pipeline is stack.GPipeSchedule)",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    assert done.stdout.strip() == "True"
    assert "stack.Pipeline is deprecated and will be removed in 0.2.0; use " in done.stderr


def test_a_module_moved_out_of_a_subpackage_imports_from_its_old_folder():
    """``planner.ema`` moved to ``optim.ema`` (and ``engine.layout`` to ``engine.plan_holder``):
    an old path inside a subpackage answers ``from nnx_spmd_trainer.planner import ema`` too,
    with the classes of the new module, warning once."""
    probe = (
        "import warnings\n"
        "warnings.simplefilter('always')\n"
        "from nnx_spmd_trainer.planner import ema\n"
        "from nnx_spmd_trainer.planner.ema import EMA\n"
        "from nnx_spmd_trainer.engine.layout import PlanHolder\n"
        "from nnx_spmd_trainer.strategies.host_layout import hosts_per_axis\n"
        "import nnx_spmd_trainer as t, nnx_spmd_trainer.optim.ema as new\n"
        "from nnx_spmd_trainer.engine import plan_holder\n"
        "from nnx_spmd_trainer.strategies import host_axes\n"
        "print(ema is new, EMA is t.EMA, PlanHolder is plan_holder.PlanHolder,\n"
        "      hosts_per_axis is host_axes.hosts_per_axis)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=300
    )
    assert done.stdout.split() == ["True"] * 4
    warned = [line for line in done.stderr.splitlines() if "DeprecationWarning" in line]
    assert [line.split("DeprecationWarning: ")[1] for line in warned] == [
        f"the module nnx_spmd_trainer.{old} is deprecated and will be removed in 0.2.0; "
        f"use nnx_spmd_trainer.{new}."
        for old, new in [
            ("planner.ema", "optim.ema"),
            ("engine.layout", "engine.plan_holder"),
            ("strategies.host_layout", "strategies.host_axes"),
        ]
    ]
