"""``--config.init_from``: the job's first state read from a Hugging Face GPT-2 file; and
``--export_format=safetensors``: the trained one written back as one."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
import safetensors.numpy
from test_cli import _cli, load, shrink
from test_cli_config_errors import TINY, assert_refused
from test_weights_gpt2 import hf_weights

from nnx_spmd_trainer.app import job, job_export, tasks
from nnx_spmd_trainer.app.models.gpt2_hf import GPT2Config


def gpt2_config(config) -> GPT2Config:
    """The HF config of the ``gpt2_hf`` job's model sizes."""
    sizes = config.gpt2_hf
    return GPT2Config(vocab_size=sizes.vocab_size, n_positions=sizes.n_positions,
                      n_embd=sizes.n_embd, n_layer=sizes.n_layer, n_head=sizes.n_head)  # fmt: skip


def test_init_from_starts_the_job_from_the_file_and_names_that_do_not_fit_are_refused(tmp_path):
    config = shrink(load("gpt2_hf"))
    gpt2 = gpt2_config(config)
    w = hf_weights(gpt2, seed=3)
    path = tmp_path / "model.safetensors"
    safetensors.numpy.save_file(w, str(path))
    # A learning rate of 0: one step leaves the parameters where they started.
    config.update(init_from=str(path), max_steps=1, learning_rate=0.0, strategy="fsdp=4,model=2")
    result = job.run(config, tmp_path / "run")
    model = result.trainer.model
    d = gpt2.n_embd
    np.testing.assert_array_equal(np.asarray(model.wte.embedding[...])[:256], w["wte.weight"])
    np.testing.assert_array_equal(np.asarray(model.wpe.embedding[...]), w["wpe.weight"])
    np.testing.assert_array_equal(
        np.asarray(model.h[0].attn.k.kernel[...]), w["h.0.attn.c_attn.weight"][:, d : 2 * d]
    )
    np.testing.assert_array_equal(
        np.asarray(model.h[0].mlp.c_fc.kernel[...]), w["h.0.mlp.c_fc.weight"]
    )
    assert result.history.steps["train/loss"][-1] == 1
    # --export_format=safetensors: HF's file again, its names and shapes, bit for bit (lr 0).
    exported = job_export.export(
        result.trainer, tmp_path / "export", "safetensors", weight_map=result.weight_map
    )
    assert exported == tmp_path / "export" / "model.safetensors"
    back = safetensors.numpy.load_file(str(exported))
    assert back.keys() == w.keys()
    for name, want in w.items():
        np.testing.assert_array_equal(back[name], want, err_msg=name)

    missing = shrink(load("gpt2_hf"))
    missing.init_from = str(tmp_path / "no-such.safetensors")
    with pytest.raises(tasks.ConfigError, match=r"config\.init_from=.*no file or directory"):
        job.run(missing, tmp_path / "missing")
    no_map = shrink(load("mlp"))
    no_map.init_from = str(path)
    # A task without a map reads a file under the model's own paths (what its
    # --export_format=safetensors writes): GPT-2's names are not the MLP's.
    with pytest.raises(
        tasks.ConfigError, match=r"config\.init_from=.*Pass weights of config\.model='mlp'"
    ):
        job.run(no_map, tmp_path / "no_map")
    for refused in ("missing", "no_map"):
        assert not (tmp_path / refused).exists(), refused


def test_export_format_without_export_is_refused_in_one_line(tmp_path):
    proc = _cli(*TINY, "--export_format=safetensors", f"--workdir={tmp_path / 'run'}", cwd=tmp_path)
    assert_refused(proc, "--export_format=safetensors without --export=DIR")
    assert not (tmp_path / "run").exists()


def test_a_damaged_or_foreign_init_from_is_refused_in_one_line_with_nothing_written(tmp_path):
    # Before: a Python traceback from TensorBoard.on_train_begin (where the state is first
    # built), exit 1, after config.json, tb/, checkpoints/ and the run lock were written.
    config = shrink(load("gpt2_hf"))
    sizes = config.gpt2_hf
    good = hf_weights(gpt2_config(config), seed=3)
    truncated = tmp_path / "truncated.safetensors"
    safetensors.numpy.save_file(good, str(truncated))
    truncated.write_bytes(truncated.read_bytes()[:-100])
    foreign = tmp_path / "foreign.safetensors"  # another model's names
    safetensors.numpy.save_file({"encoder.weight": good["wte.weight"]}, str(foreign))
    flags = [f"--config.gpt2_hf.{k}={v}" for k, v in sizes.items()]
    for path, problem in ((truncated, "damaged or unreadable"), (foreign, "missing from")):
        run = tmp_path / f"run_{path.stem}"
        proc = _cli("--config=gpt2_hf", "--config.max_steps=1", *flags,
                    f"--config.init_from={path}", f"--workdir={run}", cwd=tmp_path)  # fmt: skip
        assert_refused(proc, f"config.init_from='{path}'")
        assert problem in proc.stderr.splitlines()[-1]
        assert not run.exists()


@pytest.fixture
def full_disk(tmp_path):
    """A 4 KiB tmpfs: every file bigger than that fails with ENOSPC (needs root: skipped
    where mounting is not allowed)."""
    mount = tmp_path / "full"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", str(mount)],
                          capture_output=True, check=False)  # fmt: skip
    if made.returncode:
        pytest.skip(f"cannot mount a small tmpfs here: {made.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def test_an_export_onto_a_full_disk_is_one_line_and_leaves_no_partial_file(tmp_path, full_disk):
    # Before: a raw "OSError: [Errno 28] No space left on device" traceback from weights/save.py.
    sizes = shrink(load("gpt2_hf")).gpt2_hf
    flags = [f"--config.gpt2_hf.{k}={v}" for k, v in sizes.items()]
    export_dir = full_disk / "export"
    proc = _cli("--config=gpt2_hf", "--config.max_steps=1", *flags, f"--workdir={tmp_path / 'run'}",
                f"--export={export_dir}", "--export_format=safetensors", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"nnx-spmd-train: error: --export={export_dir}: ") and "space" in line
    assert list(export_dir.glob("*")) == []  # nothing half-written
    assert (tmp_path / "run" / "checkpoints").exists()  # the trained run is kept
