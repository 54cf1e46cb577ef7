"""The checkpoint room: what a step holds is named in one module (``format.py``), with a
format version both sides read; ``OrbaxCheckpoint`` holds its parts instead of inheriting
them; importing it changes no logging state."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from test_checkpoint import grain_data, trainer_for
from toy_models import Net

from nnx_spmd_trainer import Callback
from nnx_spmd_trainer.callbacks import OrbaxCheckpoint
from nnx_spmd_trainer.callbacks.checkpoint import NewerCheckpointFormat, format


@pytest.fixture(scope="module")
def saved_at_2(tmp_path_factory):
    directory = tmp_path_factory.mktemp("saved-2")
    trainer = trainer_for(callbacks=[OrbaxCheckpoint(directory)], model=Net)
    trainer.fit(grain_data(), max_steps=2)
    return directory


def test_a_step_holds_the_items_format_names_and_records_its_version(saved_at_2):
    items = {p.name for p in (saved_at_2 / "2").iterdir() if p.is_dir()}
    assert items == {format.STATE, format.TRAIN_METRICS, format.META, format.DATA,
                     format.FINGERPRINTS}  # fmt: skip
    meta = json.loads((saved_at_2 / "2" / format.META / "metadata").read_text())
    assert meta[format.VERSION_KEY] == format.VERSION == 1


def test_a_step_of_a_newer_format_is_refused_naming_both_versions_and_left_in_place(
    tmp_path, saved_at_2
):
    shutil.copytree(saved_at_2, tmp_path, dirs_exist_ok=True)
    meta_file = tmp_path / "2" / format.META / "metadata"
    meta = json.loads(meta_file.read_text())
    meta[format.VERSION_KEY] = format.VERSION + 1
    meta_file.write_text(json.dumps(meta))
    trainer = trainer_for(callbacks=[OrbaxCheckpoint(tmp_path)], model=Net)
    with pytest.raises(NewerCheckpointFormat, match=r"checkpoint format 2 .* up to 1"):
        trainer.fit(grain_data(), max_steps=3)
    assert (tmp_path / "2").is_dir() and not list(tmp_path.glob("2.*"))  # not damage
    assert trainer.step == 0


def test_the_callback_holds_a_writer_and_a_resumer_and_inherits_neither(tmp_path):
    checkpoint = OrbaxCheckpoint(tmp_path, local_directory=tmp_path.parent / "fast",
                                 local_every_n_steps=2)  # fmt: skip
    assert OrbaxCheckpoint.__bases__ == (Callback,)
    assert type(checkpoint.writer).__name__ == "CheckpointWriter"
    assert type(checkpoint.resumer).__name__ == "CheckpointResumer"
    assert checkpoint.writer.tiers is checkpoint.resumer.tiers is checkpoint.tiers
    assert OrbaxCheckpoint(tmp_path, restore=None).resumer is None


# A fresh interpreter: what importing the callbacks does to logging, with everything they
# import from other libraries imported before.
_IMPORT_PROBE = """
import json, logging, sys, warnings
import nnx_spmd_trainer, orbax.checkpoint, grain, tensorboardX, tqdm

def state():
    loggers = {"": logging.getLogger()} | {
        name: logger for name, logger in logging.root.manager.loggerDict.items()
        if isinstance(logger, logging.Logger)
    }
    return {
        name: [repr(f) for f in logger.filters] + [repr(h) for h in logger.handlers]
        + [logger.level, logger.propagate, logger.disabled]
        for name, logger in loggers.items()
    }

before, hook, filters = state(), sys.unraisablehook, list(warnings.filters)
import nnx_spmd_trainer.callbacks
after = state()
print(json.dumps({
    "changed": sorted(n for n in before if before[n] != after.get(n)),
    "hook": sys.unraisablehook is hook,
    "warnings": warnings.filters == filters,
}))
"""


def test_importing_the_checkpoints_changes_no_logging_state():
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_PROBE],
        capture_output=True, text=True, check=True, timeout=300,
    )  # fmt: skip
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen == {"changed": [], "hook": True, "warnings": True}
