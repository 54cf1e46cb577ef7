"""OrbaxCheckpoint by the clock (save_every_n_seconds) and in two tiers (local_directory).

Two processes saving by time: tests/test_checkpoint_time_multiprocess.py.
"""

from __future__ import annotations

import logging
import shutil
import time
import warnings
from pathlib import Path

import optax
import pytest
from test_checkpoint import (
    Crash,
    assert_bitwise,
    grain_data,
    params,
    trainer_for,
    truncate,
)
from toy_models import Net, RecordLosses, classification_loss, make_batches

from nnx_spmd_trainer import Callback, Trainer
from nnx_spmd_trainer.callbacks import OrbaxCheckpoint


class SleepAfter(Callback):
    """Sleeps ``seconds`` after each step in ``steps``: a slow step, as the clock sees it."""

    def __init__(self, steps: set[int], seconds: float) -> None:
        self.steps, self.seconds = steps, seconds

    def on_train_batch_end(self, step, logs):
        if step in self.steps:
            time.sleep(self.seconds)


class Saves(OrbaxCheckpoint):
    """OrbaxCheckpoint noting each step it saves and the tier it went to."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.saved: list[tuple[int, str]] = []

    def save(self, step: int, *, force: bool = False, local: bool = False) -> bool:
        saved = super().save(step, force=force, local=local)
        if saved:
            self.saved.append((step, "local" if local else "persistent"))
        return saved


# -- by the clock ------------------------------------------------------------------------------
def small_trainer(callbacks: list[Callback], log_every_n_steps: int | None) -> Trainer:
    return Trainer(
        Net, optax.sgd(0.1), loss_fn=classification_loss, callbacks=callbacks,
        log_every_n_steps=log_every_n_steps, track_norms=False,
    )  # fmt: skip


def test_seconds_since_the_last_save_are_checked_at_log_points_only(tmp_path):
    """Log points every 2 steps. 2.4 s pass after step 5, against save_every_n_seconds=2:
    the save comes at the next log point, step 6, and none before or after it but the
    final one."""
    checkpoint = Saves(tmp_path, save_every_n_seconds=2.0)
    trainer = small_trainer([checkpoint, SleepAfter({5}, 2.4)], log_every_n_steps=2)
    batches = make_batches(10)
    trainer.fit(batches, max_steps=2)  # compiles (its seconds are not the clock's below)
    trainer.fit(batches[2:], max_steps=10)  # the clock restarts with this fit
    assert checkpoint.saved == [(2, "persistent"), (6, "persistent"), (10, "persistent")]
    assert checkpoint.steps() == [2, 6, 10]


def test_time_check_every_n_steps_replaces_the_log_points(tmp_path):
    """Checked every 3 steps: the 2.4 s after step 4 are seen at step 6, with no log point
    at all (no MetricsLogger, no log_every_n_steps)."""
    checkpoint = Saves(tmp_path, save_every_n_seconds=2.0, time_check_every_n_steps=3)
    trainer = small_trainer([checkpoint, SleepAfter({4}, 2.4)], log_every_n_steps=None)
    batches = make_batches(8)
    trainer.fit(batches, max_steps=1)
    trainer.fit(batches[1:], max_steps=8)
    assert checkpoint.saved == [(1, "persistent"), (6, "persistent"), (8, "persistent")]


def test_seconds_with_nowhere_to_check_them_are_refused_naming_the_fixes(tmp_path):
    checkpoint = OrbaxCheckpoint(tmp_path, save_every_n_seconds=60)
    trainer = small_trainer([checkpoint], log_every_n_steps=None)
    with pytest.raises(ValueError, match=r"log_every_n_steps=.*time_check_every_n_steps="):
        trainer.fit(make_batches(1), max_steps=1)
    assert checkpoint.steps() == []


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"save_every_n_seconds": 0}, "save_every_n_seconds must be a positive number"),
        ({"time_check_every_n_steps": 5}, "needs save_every_n_seconds"),
        ({"local_every_n_steps": 2}, "local_directory and local_every_n_steps go together"),
        ({"local_directory": "x/local", "local_every_n_steps": 0}, "must be >= 1"),
    ],
)
def test_bad_settings_are_refused_when_the_callback_is_built(tmp_path, settings, message):
    with pytest.raises(ValueError, match=message):
        OrbaxCheckpoint(tmp_path, **settings)


def test_a_local_directory_inside_the_persistent_one_is_refused(tmp_path):
    with pytest.raises(ValueError, match="must not hold one another"):
        OrbaxCheckpoint(tmp_path, local_directory=tmp_path / "fast", local_every_n_steps=1)


# -- two tiers ---------------------------------------------------------------------------------
STEPS = 10


def two_tiers(root: Path, **kwargs) -> Saves:
    """Persistent every 4 steps, local every 3: local 3, persistent 4, local 6, ..."""
    return Saves(
        root / "persistent", save_every_n_steps=4,
        local_directory=root / "local", local_every_n_steps=3, **kwargs,
    )  # fmt: skip


@pytest.fixture(scope="module")
def uninterrupted() -> tuple[list[float], dict]:
    whole = RecordLosses()
    trainer = trainer_for(callbacks=[whole])  # FSDP x TP, dropout: its RNG state resumes too
    trainer.fit(grain_data(), max_steps=STEPS)
    return whole.losses, params(trainer)


@pytest.fixture(scope="module")
def crashed_at_7(tmp_path_factory) -> Path:
    """Both tiers as a run that crashed after step 6 left them."""
    root = tmp_path_factory.mktemp("tiers")
    checkpoint = two_tiers(root)
    trainer = trainer_for(callbacks=[checkpoint, Crash(7)])
    with pytest.raises(RuntimeError, match="simulated crash"):
        trainer.fit(grain_data(), max_steps=STEPS)
    assert checkpoint.saved == [(3, "local"), (4, "persistent"), (6, "local")]
    assert checkpoint.steps() == [4] and checkpoint.local_steps() == [3, 6]
    return root


def resumed(root: Path) -> tuple[Saves, list[float], dict]:
    after = RecordLosses()
    checkpoint = two_tiers(root)
    trainer = trainer_for(callbacks=[checkpoint, after])
    trainer.fit(grain_data(), max_steps=STEPS)
    assert trainer.step == STEPS
    return checkpoint, after.losses, params(trainer)


def test_with_both_tiers_intact_the_newer_local_step_is_resumed_bitwise(
    tmp_path, crashed_at_7, uninterrupted
):
    shutil.copytree(crashed_at_7, tmp_path, dirs_exist_ok=True)
    checkpoint, losses, final = resumed(tmp_path)
    whole_losses, whole_params = uninterrupted
    assert checkpoint.restored_step == 6
    assert losses == whole_losses[6:]  # bitwise, step by step
    assert_bitwise(final, whole_params)
    assert checkpoint.saved == [(8, "persistent"), (9, "local"), (10, "persistent")]


def delete(step_dir: Path) -> None:
    shutil.rmtree(step_dir)


@pytest.mark.parametrize("damage", [truncate, delete])
def test_a_damaged_or_lost_local_step_falls_back_to_the_persistent_tier_bitwise(
    tmp_path, crashed_at_7, uninterrupted, damage
):
    shutil.copytree(crashed_at_7, tmp_path, dirs_exist_ok=True)
    damage(tmp_path / "local" / "6")
    if damage is delete:
        checkpoint, losses, final = resumed(tmp_path)
    else:
        with pytest.warns(RuntimeWarning, match=f"checkpoint step 6 at {tmp_path / 'local'}"):
            checkpoint, losses, final = resumed(tmp_path)
        assert (tmp_path / "local" / "6.damaged").is_dir()  # set aside in its own tier
    whole_losses, whole_params = uninterrupted
    assert checkpoint.restored_step == 4  # the persistent step, newer than local 3
    assert losses == whole_losses[4:]
    assert_bitwise(final, whole_params)
    assert checkpoint.steps() == [4, 8, 10] and checkpoint.local_steps() == [3, 6, 9]


class Records(logging.Handler):
    """Every record of the loggers Orbax and its reads report through (absl, asyncio)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def __enter__(self) -> Records:
        for name in ("absl", "asyncio"):
            logging.getLogger(name).addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        for name in ("absl", "asyncio"):
            logging.getLogger(name).removeHandler(self)


def test_a_restart_from_the_local_tier_names_that_tier_and_its_directory(tmp_path, crashed_at_7):
    shutil.copytree(crashed_at_7, tmp_path, dirs_exist_ok=True)
    lines: list[str] = []
    checkpoint = two_tiers(tmp_path, print_fn=lines.append)
    trainer_for(callbacks=[checkpoint]).fit(grain_data(), max_steps=7)
    assert lines[0] == f"resuming from checkpoint step 6 in {tmp_path / 'local'} (the local tier)"


def test_a_damaged_local_step_is_reported_once(tmp_path, crashed_at_7):
    """One line through print_fn, and no warning or log record saying it again."""
    shutil.copytree(crashed_at_7, tmp_path, dirs_exist_ok=True)
    truncate(tmp_path / "local" / "6")
    lines: list[str] = []
    checkpoint = two_tiers(tmp_path, print_fn=lines.append)
    with warnings.catch_warnings(record=True) as caught, Records() as logged:
        warnings.simplefilter("always")
        trainer_for(callbacks=[checkpoint]).fit(grain_data(), max_steps=5)
    step_6 = str(tmp_path / "local" / "6")
    told = [line for line in lines if step_6 in line]
    assert len(told) == 1 and "6.damaged" in told[0], lines
    assert not [w for w in caught if step_6 in str(w.message)]
    assert not [line for line in logged.lines if step_6 in line]
    assert lines[-1].startswith("resuming from checkpoint step 4 in")


def test_without_print_fn_a_damaged_step_is_one_warning(tmp_path, crashed_at_7):
    shutil.copytree(crashed_at_7, tmp_path, dirs_exist_ok=True)
    truncate(tmp_path / "local" / "6")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer_for(callbacks=[two_tiers(tmp_path)]).fit(grain_data(), max_steps=5)
    about_6 = [w for w in caught if f"checkpoint step 6 at {tmp_path / 'local'}" in str(w.message)]
    assert len(about_6) == 1 and about_6[0].category is RuntimeWarning


def half_delete(step_dir: Path) -> None:
    """What Orbax's deletion of an old step leaves when the process is killed in it: the
    step's top files gone (its metadata, its commit marker) and some of its items."""
    (step_dir / "_CHECKPOINT_METADATA").unlink()
    (step_dir / "commit_success.txt").unlink()
    shutil.rmtree(step_dir / "state")


def test_a_local_step_left_half_deleted_by_a_kill_is_cleaned_quietly(tmp_path, crashed_at_7):
    """Local steps 3 and 6, keep=1: Orbax's policy dropped 3, and a kill stopped its
    deletion half-way. The restart removes it before anything lists the tier, saying
    nothing, whether asked read-only first (as the CLI does) or not."""
    shutil.copytree(crashed_at_7, tmp_path, dirs_exist_ok=True)
    half_delete(tmp_path / "local" / "3")
    lines: list[str] = []
    checkpoint = two_tiers(tmp_path, keep=1, print_fn=lines.append)
    trainer = trainer_for(callbacks=[checkpoint])
    with warnings.catch_warnings(record=True) as caught, Records() as logged:
        warnings.simplefilter("always")
        assert checkpoint.resumes()
        assert checkpoint.layout_to_resume() is not None
        assert (tmp_path / "local" / "3").is_dir()  # read-only: nothing removed yet
        trainer.fit(grain_data(), max_steps=7)
    assert not [line for line in logged.lines if "Metadata file does not exist" in line]
    assert not [w for w in caught if "local" in str(w.message)]
    assert lines == [f"resuming from checkpoint step 6 in {tmp_path / 'local'} (the local tier)"]
    assert not (tmp_path / "local" / "3").exists()
    assert checkpoint.restored_step == 6


def test_the_whole_local_tier_lost_resumes_from_the_persistent_one(tmp_path, crashed_at_7):
    """A new machine: the fast disk is empty; restore_into reads the persistent tier."""
    shutil.copytree(crashed_at_7 / "persistent", tmp_path / "persistent")
    checkpoint = two_tiers(tmp_path)
    trainer = trainer_for()
    assert checkpoint.restore_into(trainer) == 4 and trainer.step == 4


# -- the command line ----------------------------------------------------------------------------
@pytest.mark.slow
def test_the_cli_saves_by_seconds_at_its_log_points(tmp_path):
    """``--config.save_every_n_seconds`` reaches the job's OrbaxCheckpoint: with a second's
    thousandth every log point is due, so steps 4-6 are kept (keep=3) where steps alone
    (``checkpoint_every_n_steps=0``) would have saved the final one only."""
    from test_cli import _cli

    workdir = tmp_path / "run"
    proc = _cli(
        "--config=mlp", "--config.max_steps=6", "--config.log_every_n_steps=1",
        "--config.checkpoint_every_n_steps=0", "--config.save_every_n_seconds=0.001",
        f"--workdir={workdir}", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert OrbaxCheckpoint(workdir / "checkpoints").steps() == [4, 5, 6]


def test_a_negative_number_of_seconds_is_a_config_error_naming_the_key():
    import ml_collections

    from nnx_spmd_trainer.app.run_config import ConfigError, check_config

    with pytest.raises(ConfigError, match=r"config.save_every_n_seconds=-1.0: must be a finite"):
        check_config(ml_collections.ConfigDict({"save_every_n_seconds": -1.0}))
