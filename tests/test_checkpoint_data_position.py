"""OrbaxCheckpoint: the saved Grain data position is read and checked with the other items.

A position that does not parse, is missing, or cannot be where the step was is damage,
found in the restore's fallback loop: the step is set aside and the one before it used,
and the run ends bitwise where an uninterrupted run ends (issue 17, items 3 and 4).
"""

import json
import re
import shutil
import warnings
from pathlib import Path

import grain
import numpy as np
import optax
import pytest
from test_checkpoint import assert_bitwise, params
from toy_models import Net, classification_loss, make_batches

from nnx_spmd_trainer import Trainer
from nnx_spmd_trainer.callbacks import OrbaxCheckpoint

STEPS = 9  # 5 batches an epoch: checkpoints at 3 (epoch 0) and 6 (epoch 1, batch 1)
POSITION = Path("data") / "process_0-of-1.json"
ROWS = make_batches(1, batch_size=80)[0]


def lookup(i):
    return {"x": ROWS["x"][i], "y": ROWS["y"][i]}


def batches_data() -> grain.MapDataset:
    """Its iterator's position counts batches: ``{"next_index": <batches taken>}``."""
    return grain.MapDataset.source(np.arange(80)).shuffle(seed=1).batch(16).map(lookup)


def rows_data() -> grain.IterDataset:
    """The same batches, from an iterator whose position counts rows (16 a batch)."""
    return (
        grain.MapDataset.source(np.arange(80))
        .shuffle(seed=1)
        .to_iter_dataset()
        .batch(16)
        .map(lookup)
    )


def trainer_for(*callbacks) -> Trainer:
    return Trainer(Net, optax.adamw(1e-2), loss_fn=classification_loss, callbacks=list(callbacks))


@pytest.fixture(scope="module")
def uninterrupted() -> dict[str, np.ndarray]:
    trainer = trainer_for()
    trainer.fit(batches_data(), max_steps=STEPS)
    return params(trainer)


def saved_run(directory: Path, data) -> Path:
    trainer_for(OrbaxCheckpoint(directory, save_every_n_steps=3)).fit(data, max_steps=6)
    assert OrbaxCheckpoint(directory).steps() == [3, 6]
    return directory


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    return saved_run(tmp_path_factory.mktemp("batches"), batches_data())


@pytest.fixture
def checkpoints(saved, tmp_path) -> Path:
    """A copy of the saved run for one test to damage."""
    return Path(shutil.copytree(saved, tmp_path / "ckpt"))


def position(step_dir: Path) -> dict:
    return json.loads((step_dir / POSITION).read_text())


def set_position(step_dir: Path, state: dict) -> None:
    (step_dir / POSITION).write_text(json.dumps(state, indent=4))


def one_batch_back(step_dir: Path) -> None:
    state = position(step_dir)
    assert state == {"next_index": 1}  # epoch 1, after its first batch
    set_position(step_dir, {"next_index": 0})


def truncated(step_dir: Path) -> None:
    text = (step_dir / POSITION).read_text()
    (step_dir / POSITION).write_text(text[: len(text) // 2])


def deleted(step_dir: Path) -> None:
    (step_dir / POSITION).unlink()


def resume_falls_back_to_3(checkpoints: Path, uninterrupted) -> None:
    reports: list[str] = []
    checkpoint = OrbaxCheckpoint(checkpoints, print_fn=reports.append)
    resumed = trainer_for(checkpoint)
    damaged = re.escape(f"checkpoint step 6 at {checkpoints / '6'}")
    resumed.fit(batches_data(), max_steps=STEPS)  # reported through print_fn alone
    assert checkpoint.restored_step == 3 and resumed.step == STEPS
    assert (checkpoints / "6.damaged").is_dir()  # set aside, not deleted
    (told,) = [line for line in reports if "6.damaged" in line]
    assert re.search(f"{damaged}.*{re.escape(str(POSITION))}", told), told
    assert_bitwise(params(resumed), uninterrupted)


def test_a_data_position_behind_the_batches_taken_is_set_aside_and_the_run_falls_back(
    checkpoints, uninterrupted
):
    one_batch_back(checkpoints / "6")  # resumed as is, it trains batch 0 of epoch 1 again
    resume_falls_back_to_3(checkpoints, uninterrupted)


@pytest.mark.parametrize("damage", [truncated, deleted])
def test_an_unreadable_data_position_is_set_aside_and_the_run_falls_back(
    checkpoints, uninterrupted, damage
):
    damage(checkpoints / "6")  # found in fit's restore loop, not later when the data starts
    resume_falls_back_to_3(checkpoints, uninterrupted)


def one_batch_ahead(step_dir: Path) -> None:
    set_position(step_dir, {"next_index": position(step_dir)["next_index"] + 1})


def test_a_data_position_ahead_is_set_aside(checkpoints, uninterrupted):
    """Found against the position the save recorded in the metadata."""
    one_batch_ahead(checkpoints / "6")
    resume_falls_back_to_3(checkpoints, uninterrupted)


def test_a_position_counted_in_rows_is_not_mistaken_for_damage(tmp_path, uninterrupted):
    checkpoints = saved_run(tmp_path, rows_data())
    assert position(checkpoints / "6") == {"next_index": 16}  # rows, not batches
    checkpoint = OrbaxCheckpoint(checkpoints)
    resumed = trainer_for(checkpoint)
    resumed.fit(rows_data(), max_steps=STEPS)
    assert checkpoint.restored_step == 6 and not (checkpoints / "6.damaged").exists()
    assert_bitwise(params(resumed), uninterrupted)  # the same batches as batches_data()


def without_recorded_position(step_dir: Path) -> None:
    """The step as written before its metadata recorded the data position."""
    meta_file = step_dir / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    assert meta.pop("data_position") == {"next_index": 1}
    meta_file.write_text(json.dumps(meta))


def test_a_step_saved_before_the_metadata_recorded_the_position_resumes_exactly(
    checkpoints, uninterrupted
):
    """Without the record the position is read back as bytes (Grain's JSON text), and the
    resumed epoch's ``DatasetIterator`` is set to the dict they hold: the step is neither
    set aside nor resumed by reading and discarding batches."""
    without_recorded_position(checkpoints / "6")
    checkpoint = OrbaxCheckpoint(checkpoints)
    resumed = trainer_for(checkpoint)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*no restorable position")
        resumed.fit(batches_data(), max_steps=STEPS)
    assert checkpoint.restored_step == 6 and not (checkpoints / "6.damaged").exists()
    assert_bitwise(params(resumed), uninterrupted)


def loader_data() -> grain.DataLoader:
    """A ``DataLoader``, whose position is bytes (Grain saves it as text, not JSON)."""
    return grain.DataLoader(
        data_source=[lookup(i) for i in range(80)],
        sampler=grain.samplers.IndexSampler(
            80, shard_options=grain.sharding.NoSharding(), shuffle=True, seed=1, num_epochs=1
        ),
        operations=[grain.transforms.Batch(16)],
        worker_count=0,
    )


def test_a_data_loader_position_is_read_back_as_bytes_and_resumes_exactly(tmp_path):
    """The restore reads the position as a value (``RunState.data``, bytes here), and the
    resumed epoch's iterator is set to it: no batch is skipped by reading it."""
    whole = trainer_for()
    whole.fit(loader_data(), max_steps=STEPS)
    checkpoints = saved_run(tmp_path, loader_data())
    checkpoint = OrbaxCheckpoint(checkpoints)
    resumed = trainer_for(checkpoint)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*no restorable position")
        resumed.fit(loader_data(), max_steps=STEPS)
    assert checkpoint.restored_step == 6 and resumed.step == STEPS
    assert_bitwise(params(resumed), params(whole))
