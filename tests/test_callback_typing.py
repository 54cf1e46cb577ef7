"""A callback's ``self.trainer`` is typed as the real ``Trainer`` under mypy, though neither
the engine nor ``trainer.py`` imports the ``Callback`` class (``nnx_spmd_trainer/callback.py``
binds the engine's ``BaseCallback`` to ``Trainer`` one layer above the trainer)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MYPY = Path(sys.executable).with_name("mypy")
# `make test` runs mypy on the package just before pytest: starting from a copy of its cache,
# mypy re-checks only the probe and whatever changed since (it validates every cached module
# against its source's hash), ~4 s instead of ~60 s cold through jax and flax. A copy, so the
# probe never lands in the project's own cache; without one, mypy checks everything cold.
PROJECT_CACHE = REPO / ".mypy_cache"

USER_CALLBACK = """
from flax import nnx

from nnx_spmd_trainer import Callback, Logs, Trainer


class Probe(Callback):
    def on_train_end(self, logs: Logs) -> None:
        reveal_type(self.trainer)
        reveal_type(self.trainer.plan)
        self.trainer.no_such_attribute


def build(model: nnx.Module, probe: Probe) -> Trainer:
    return Trainer(model, callbacks=[probe])
"""


@pytest.mark.slow
def test_a_user_callback_sees_the_trainer_typed_and_a_misspelt_attribute_fails(
    tmp_path: Path,
) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(USER_CALLBACK)
    cache = tmp_path / "cache"
    if PROJECT_CACHE.is_dir():
        shutil.copytree(PROJECT_CACHE, cache)
    done = subprocess.run(
        [str(MYPY), "--cache-dir", str(cache), str(probe)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = done.stdout
    assert 'Revealed type is "nnx_spmd_trainer.trainer.Trainer"' in out, out
    assert 'Revealed type is "nnx_spmd_trainer.planner.plan.Plan"' in out, out
    assert '"Trainer" has no attribute "no_such_attribute"' in out, out
    # The one error is the misspelt attribute: Trainer(callbacks=[probe]) type-checks.
    assert "Found 1 error" in out, out
