"""A config that cannot run is refused before anything is written: one line naming the key
and the fix on stderr, exit status 2, no traceback, the workdir as it was."""

import os
from pathlib import Path

import ml_collections
import pytest
from test_cli import _cli, load, shrink

from nnx_spmd_trainer.app import job, tasks
from nnx_spmd_trainer.app.workdir import check_writable

TINY = ("--config=mlp", "--config.max_steps=2")  # the failures come before any step


def tree(root: Path) -> set[str]:
    """Every path under ``root``, relative: what a refused run must leave as it was."""
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def assert_refused(proc, key: str) -> None:
    """Exit 2 and one last line, ``nnx-spmd-train: error: ...``, naming ``key``."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines, "nothing on stderr"
    assert lines[-1].startswith("nnx-spmd-train: error: "), lines[-1]
    assert key in lines[-1], lines[-1]


# -- through the command line, one process each ---------------------------------------------
# One process per way a value is refused: a range (check_config), a batch the layout
# cannot split, an unknown key, a value that does not parse. Other keys out of range take
# check_config's path too: their messages are checked in this process below.
@pytest.mark.parametrize(
    "override, key, fix",
    [
        ("--config.max_steps=-1", "config.max_steps=-1", "--config.max_steps=300"),
        ("--config.batch_size=3", "config.batch_size=3", "divisible by 4"),  # data=4 in mlp
        ("--config.nope=1", "--config.nope", "mlp.py"),
        ("--config.max_steps=abc", "--config.max_steps=abc", "invalid literal for int()"),
    ],
)
def test_a_bad_value_is_one_line_exit_2_and_writes_nothing(tmp_path, override, key, fix):
    proc = _cli(*TINY, override, f"--workdir={tmp_path / 'run'}", cwd=tmp_path)
    assert_refused(proc, key)
    assert fix in proc.stderr.splitlines()[-1]
    assert tree(tmp_path) == set()  # not even the workdir


def test_a_workdir_under_a_file_is_one_line_exit_2(tmp_path):
    (tmp_path / "afile").write_text("")
    workdir = tmp_path / "afile" / "sub"  # can never be created, root or not
    proc = _cli(*TINY, f"--workdir={workdir}", cwd=tmp_path)
    assert_refused(proc, f"--workdir={workdir} is not writable")
    assert "afile is a file, not a directory" in proc.stderr
    assert tree(tmp_path) == {"afile"}


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores permissions: chmod cannot refuse it")
def test_a_read_only_workdir_is_one_line_exit_2(tmp_path):
    readonly = tmp_path / "ro"
    readonly.mkdir()
    readonly.chmod(0o500)
    try:
        proc = _cli(*TINY, f"--workdir={readonly / 'run'}", cwd=tmp_path)
    finally:
        readonly.chmod(0o700)
    assert_refused(proc, f"--workdir={readonly / 'run'} is not writable")
    assert tree(tmp_path) == {"ro"}


def test_an_occupied_export_path_is_one_line_exit_2(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "params").write_text("earlier")
    before = tree(tmp_path)
    proc = _cli(*TINY, "--export=out", f"--workdir={tmp_path / 'run'}", cwd=tmp_path)
    assert_refused(proc, f"--export={tmp_path / 'out'} exists")
    assert tree(tmp_path) == before  # no workdir, the export path untouched
    assert (tmp_path / "out" / "params").read_text() == "earlier"


@pytest.mark.parametrize(
    "args, key",
    [
        (["--export=out", "--export_ema"], "--export_ema: this run keeps no average"),
        (["--export_ema", "--config.ema_decay=0.9"], "--export_ema without --export=DIR"),
    ],
)
def test_export_ema_without_an_average_or_a_directory_is_one_line_exit_2(tmp_path, args, key):
    proc = _cli(*TINY, *args, f"--workdir={tmp_path / 'run'}", cwd=tmp_path)
    assert_refused(proc, key)
    assert tree(tmp_path) == set()  # refused before anything is trained or written


# -- in this process: every key's range, and run() checking before it writes ---------------
@pytest.mark.parametrize(
    "key, value, fix",
    [
        ("checkpoint_every_n_steps", -1, "=0"),
        ("grad_accum_steps", 0, "grad_accum_steps=1"),
    ],
)
def test_a_range_error_names_the_key_and_the_fix_and_writes_nothing(tmp_path, key, fix, value):
    """What the command line prints for these (after ``nnx-spmd-train: error: ``, exit 2,
    as for max_steps=-1 above): the key, its value and the fix, nothing written."""
    config = load("mlp")
    config.update({"max_steps": 2, key: value})
    with pytest.raises(tasks.ConfigError) as refused:
        job.run(config, tmp_path / "run")
    (line,) = str(refused.value).splitlines()
    assert f"config.{key}={value}" in line and fix in line
    assert tree(tmp_path) == set()


@pytest.mark.parametrize(
    "key, value",
    [
        ("max_steps", 0),
        ("batch_size", -8),
        ("grad_accum_steps", 0),
        ("max_steps_in_flight", 0),
        ("log_every_n_steps", 0),
        ("num_devices", 0),
        ("eval_every_n_steps", -1),
        ("checkpoint_every_n_steps", -5),
        ("max_eval_batches", -1),
        ("warmup_steps", -1),
        ("max_steps", 2.5),
        ("learning_rate", -1e-3),
        ("learning_rate", float("nan")),
        ("weight_decay", -0.1),
        ("grad_clip_norm", 0.0),
        ("end_lr_fraction", float("inf")),
        ("compute_dtype", "bf16"),
    ],
)
def test_check_config_names_the_key_out_of_range(key, value):
    # A config file may hold any value (overrides on the command line are type-checked).
    config = ml_collections.ConfigDict({**load("mlp").to_dict(), key: value})
    with pytest.raises(tasks.ConfigError, match=f"^config.{key}="):
        tasks.check_config(config)


@pytest.mark.parametrize("name", ["default", "mlp", "cnn", "dp", "fsdp", "tp", "hybrid"])
def test_the_shipped_configs_and_their_off_switches_pass(name):
    config = load(name)
    tasks.check_config(config)
    config.update(eval_every_n_steps=0, checkpoint_every_n_steps=0, max_eval_batches=0)
    tasks.check_config(config)
    tasks.check_config(ml_collections.ConfigDict({**config.to_dict(), "max_eval_batches": None}))


def test_check_writable_reads_the_permissions_of_the_nearest_existing_folder(tmp_path, monkeypatch):
    asked = []
    monkeypatch.setattr(os, "access", lambda path, mode: asked.append(path) and False)
    with pytest.raises(tasks.ConfigError, match=r"is not writable \(its parent .* is not\)"):
        check_writable(tmp_path / "a" / "b", "--export")
    assert asked == [tmp_path]
    with pytest.raises(tasks.ConfigError, match=r"^--workdir=.* is not writable: permission"):
        check_writable(tmp_path, "--workdir")


def test_check_writable_writes_nothing(tmp_path):
    assert check_writable(tmp_path / "a" / "b", "--workdir") == tmp_path / "a" / "b"
    assert tree(tmp_path) == set()
    (tmp_path / "f").write_text("")
    with pytest.raises(tasks.ConfigError, match=r"--workdir=.*/f is not writable: it is a file"):
        check_writable(tmp_path / "f", "--workdir")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"batch_size": 12}, "config.batch_size=12: .* divisible by 8"),  # dp=8 in the default
        ({"batch_size": 16, "grad_accum_steps": 4}, "with config.grad_accum_steps=4: "),
        ({"strategy": "data=3"}, "config.strategy='data=3': .*does not fit"),
        ({"max_steps": -1}, "config.max_steps=-1"),
        ({"strategy": "data=2,model=4", "across_hosts": "data=2"},
         r"config.across_hosts='data=2': .*asks for 2 hosts, .* on 1 process of \[8\]"),
        ({"across_hosts": "data"}, r"config.across_hosts='data': 'data' is not axis=hosts"),
        ({"strategy": "data=2,model=4", "across_hosts": "stage=2"},
         r"config.across_hosts='stage=2': .*\['stage'\] are not mesh axes"),
        ({"strategy": "auto", "across_hosts": "data=2"}, "not those 'auto' chooses"),
        ({"across_hosts": "data=2,data=1"}, r"across_hosts='data=2,data=1' names 'data' twice"),
        ({"strategy": "data=3", "across_hosts": "data=2"}, "config.strategy='data=3': "),
    ],
)  # fmt: skip
def test_run_refuses_before_writing_anything(tmp_path, change, message):
    config = shrink(load("mlp"))
    config.strategy = "data"
    config.update(change)
    with pytest.raises(tasks.ConfigError, match=message):
        job.run(config, tmp_path / "run")
    assert tree(tmp_path) == set()


def test_a_layer_the_layout_cannot_split_names_the_strategy_and_the_model(tmp_path):
    config = shrink(load("mlp"))  # data=4,model=2
    config.mlp.hidden_dim = 33
    with pytest.raises(tasks.ConfigError, match=r"config.strategy=.* \(or config.mlp\): .*33"):
        job.run(config, tmp_path / "run")
    assert tree(tmp_path) == set()


def test_check_config_accepts_a_config_without_the_optional_keys():
    tasks.check_config(ml_collections.ConfigDict({"model": "mlp"}))
