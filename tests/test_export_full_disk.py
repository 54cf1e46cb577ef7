"""Every export (PEFT, merged, safetensors, Orbax) onto a full disk: an ``OSError`` in one
line (safetensors' own ``SafetensorError`` too), nothing left that looks done (no file at
the export's path, no ``.partial`` folder), and the same export succeeds once there is
room. The disk is a small ``tmpfs`` filled to the last byte (root only: skipped elsewhere);
then the command line's ``--export`` on it: one line, exit 1, and the same command again."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="mounting a tmpfs needs root"
)

RANK, ALPHA = 2, 6.0


@pytest.fixture(scope="module")
def disk(tmp_path_factory) -> Iterator[Path]:
    """A 2 MiB tmpfs, unmounted at the end."""
    where = tmp_path_factory.mktemp("disk")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@contextlib.contextmanager
def full(disk: Path) -> Iterator[None]:
    """The disk filled to its last byte while inside; the room given back after."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        for size in (1 << 16, 4096, 512, 1):  # down to the last byte
            try:
                while os.write(fd, b"\0" * size):
                    pass
            except OSError:
                continue
    finally:
        os.close(fd)
    try:
        yield
    finally:
        filler.unlink()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny GPT-2 from a safetensors file, with the plan's LoRA, trained two steps."""
    import optax
    import safetensors.numpy
    from test_finetune_checkpoints import CONFIG, batches
    from test_weights_gpt2 import hf_weights

    from nnx_spmd_trainer import FSDP, Trainer, weights
    from nnx_spmd_trainer.app.models.gpt2_hf import GPT2, gpt2_weight_map, loss_fn
    from nnx_spmd_trainer.nn.lora import LoRA

    base = tmp_path_factory.mktemp("base") / "model.safetensors"
    safetensors.numpy.save_file(hf_weights(CONFIG, seed=5), str(base))
    weight_map = gpt2_weight_map(CONFIG)
    trainer = Trainer(
        lambda rngs: GPT2(CONFIG, rngs), optax.sgd(0.5), strategy=FSDP(8), loss_fn=loss_fn,
        lora=LoRA(rank=RANK, alpha=ALPHA, targets=r".*attn/(q|v)"),
        init_from=weights.Pretrained(base, weight_map), track_norms=False,
    )  # fmt: skip
    trainer.fit(batches(2), max_steps=2)
    plain = Trainer(
        lambda rngs: GPT2(CONFIG, rngs), optax.sgd(0.5), strategy=FSDP(8), loss_fn=loss_fn,
        init_from=weights.Pretrained(base, weight_map), track_norms=False,
    )  # fmt: skip
    return trainer, plain, weight_map


@pytest.mark.parametrize("export_format", ["peft", "merged", "safetensors", "orbax"])
def test_a_full_disk_leaves_nothing_done_and_the_same_export_then_succeeds(
    disk, trained, export_format
):
    from nnx_spmd_trainer.app import job_export

    lora_trainer, plain, weight_map = trained
    # safetensors is the whole model's format: a LoRA run's goes out merged or as PEFT
    trainer = plain if export_format == "safetensors" else lora_trainer
    out = disk / export_format
    with full(disk):
        with pytest.raises(OSError) as failed:
            job_export.export(trainer, out, export_format, weight_map=weight_map)
        assert "\n" not in str(failed.value) and str(failed.value)
        assert not out.exists()
        assert sorted(p.name for p in disk.iterdir()) == ["filler"]  # no .partial left
    path = job_export.export(trainer, out, export_format, weight_map=weight_map)
    assert not list(disk.glob("*.partial"))
    check_export(trainer, weight_map, path, export_format)
    for p in sorted(out.rglob("*"), reverse=True):  # room for the next format
        p.unlink() if p.is_file() else p.rmdir()
    out.rmdir()


def check_export(trainer, weight_map, path: Path, export_format: str) -> None:
    """What the export holds, read back with the file format's own reader."""
    import orbax.checkpoint as ocp
    import safetensors.numpy
    from flax import nnx

    from nnx_spmd_trainer import weights

    if export_format == "safetensors":
        file = safetensors.numpy.load_file(str(path))
        assert file.keys() == weight_map.sources().keys()
        w = np.asarray(trainer.model.h[0].attn.c_proj.kernel[...])
        np.testing.assert_array_equal(file["h.0.attn.c_proj.weight"], w)
        return
    q = trainer.model.h[0].attn.q
    w, a, b = (np.asarray(v[...], np.float64) for v in (q.kernel, q.lora_a, q.lora_b))
    if export_format == "peft":
        adapter = weights.read_peft_adapter(path)
        assert adapter.config["r"] == RANK and adapter.config["lora_alpha"] == ALPHA
        assert json.loads((path / "adapter_config.json").read_text())["peft_type"] == "LORA"
    elif export_format == "merged":
        file = safetensors.numpy.load_file(str(path))
        d = w.shape[0]
        want = w + ALPHA / RANK * a @ b
        np.testing.assert_allclose(file["h.0.attn.c_attn.weight"][:, :d], want, rtol=1e-5)
    else:
        restored = ocp.PyTreeCheckpointer().restore(path)
        saved_b = restored["h"]["0"]["attn"]["q"]["lora_b"]
        np.testing.assert_array_equal(saved_b, b.astype(np.float32))
        assert len(nnx.state(trainer.model, nnx.Param)) > 0


@pytest.mark.serial
def test_the_command_line_says_one_line_and_the_same_command_then_succeeds(disk, tmp_path):
    """``--export`` onto a full disk: exit 1, one line naming the cause and the fix, no
    traceback, nothing at the export's path; once there is room the same command exports
    (the run resumes from its checkpoints and trains nothing more)."""
    from conftest import environment_for_own_devices

    command = [
        sys.executable, "-m", "nnx_spmd_trainer", "--config=default", "--config.max_steps=2",
        "--config.batch_size=16", "--config.eval_every_n_steps=0", "--config.max_eval_batches=1",
        "--config.gpt.seq_len=16", "--config.gpt.embed_dim=32", "--config.gpt.num_heads=8",
        "--config.gpt.ff_dim=64", "--config.gpt.num_layers=1", "--config.lora.rank=2",
        f"--workdir={tmp_path / 'run'}", f"--export={disk / 'merged'}", "--export_format=merged",
    ]  # fmt: skip
    env = environment_for_own_devices()
    with full(disk):
        proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)  # fmt: skip
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        last = [line for line in proc.stderr.splitlines() if line.strip()][-1]
        assert last.startswith("nnx-spmd-train: error: --export=") and "No space left" in last
        assert "run the same command again" in last
        assert sorted(p.name for p in disk.iterdir()) == ["filler"]
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in (disk / "merged").iterdir()) == [
        "model.safetensors",
        "tokenizer.json",
    ]
