"""A LoRA run killed with SIGKILL resumes bitwise (issue 47): the command line's run with
``--config.lora.rank`` (whole-state checkpoints) gives the same per-step losses and final
weights, adapters included, as a run never stopped; a user's script checkpointing the
adapters alone (``OrbaxCheckpoint(trainable_only=True)``) resumes onto its base loaded
afresh from the weights file, to the same losses and adapters (slow, subprocesses)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import optax
import pytest
import safetensors.numpy
from flax import nnx
from test_checkpoint_cli import environment, exported, losses, start_and_stop
from test_weights_gpt2 import hf_weights
from toy_models import RecordLosses, flat_params

from nnx_spmd_trainer import FSDP, LoRA, Trainer, weights
from nnx_spmd_trainer.app.models.gpt2_hf import GPT2, GPT2Config, gpt2_weight_map, loss_fn
from nnx_spmd_trainer.callbacks import OrbaxCheckpoint

pytestmark = [pytest.mark.slow, pytest.mark.serial]

# -- the command line: --config.lora.rank, killed after its step-3 checkpoint ------------------
TINY_LORA = [
    "--config.max_steps=6",
    "--config.batch_size=8",
    "--config.num_devices=4",
    "--config.log_every_n_steps=1",  # metrics.csv then holds every step's loss
    "--config.eval_every_n_steps=100",  # one evaluation, at the end
    "--config.max_eval_batches=1",
    "--config.checkpoint_every_n_steps=3",
    "--config.loggers=csv",
    "--config.gpt.seq_len=16",
    "--config.gpt.embed_dim=32",
    "--config.gpt.num_heads=4",
    "--config.gpt.ff_dim=64",
    "--config.gpt.num_layers=1",
    "--config.lora.rank=4",
    "--config.lora.targets=.*mha/(query|value)",
]


def lora_command(workdir: Path) -> list[str]:
    return [
        sys.executable, "-m", "nnx_spmd_trainer", f"--workdir={workdir}",
        f"--export={workdir}-export", *TINY_LORA,
    ]  # fmt: skip


def run_lora_cli(workdir: Path) -> None:
    proc = subprocess.run(
        lora_command(workdir), env=environment(), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_a_lora_run_killed_with_sigkill_resumes_bitwise(tmp_path, monkeypatch):
    import test_checkpoint_cli

    reference, workdir = tmp_path / "whole", tmp_path / "run"
    run_lora_cli(reference)
    # start_and_stop runs test_checkpoint_cli's command: this test's, for this test.
    monkeypatch.setattr(test_checkpoint_cli, "command", lambda w, *e, **k: lora_command(w))
    killed = start_and_stop(workdir, signal.SIGKILL, after_step=3)
    assert killed.returncode == -signal.SIGKILL
    assert not (workdir / "checkpoints" / "6").exists()
    run_lora_cli(workdir)  # the same command again: it resumes from step 3

    assert [step for step, _ in losses(workdir)][-3:] == [4, 5, 6]
    assert losses(workdir) == losses(reference)  # every step as printed, no row twice
    ours, theirs = exported(workdir), exported(reference)
    adapters = [k for k in ours if k.endswith(("lora_a", "lora_b"))]
    assert len(adapters) == 4, sorted(ours)  # query and value of the one block
    assert ours.keys() == theirs.keys()
    for key in ours:
        np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)
    assert any(np.abs(ours[k]).max() > 0 for k in adapters if k.endswith("lora_b"))  # trained


# -- a script of the user's: adapters-only checkpoints, the base read from its file ----------
CONFIG = GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2, dropout=0.1)
ADAPTERS = LoRA(rank=2, alpha=4.0, targets=r".*attn/(q|v)", dropout=0.1)  # RNG state to keep
STEPS, EVERY, KILL_AT = 6, 2, 3

SCRIPT = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from test_lora_kill import adapter_checkpoints, batches, trainer_for
from nnx_spmd_trainer import Callback

base, directory, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
checkpoint = adapter_checkpoints(directory)

class Kill(Callback):
    def on_step_end(self, step):
        if step == kill_at:
            checkpoint.manager.wait_until_finished()
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no final save

trainer_for(base, [checkpoint, Kill()]).fit(batches(), max_steps={steps})
"""


def batches() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    rows = rng.integers(0, CONFIG.vocab_size, size=(STEPS, 8, 9)).astype(np.int32)
    return [{"inputs": r[:, :-1], "targets": r[:, 1:]} for r in rows]


def adapter_checkpoints(directory: str | Path) -> OrbaxCheckpoint:
    return OrbaxCheckpoint(directory, save_every_n_steps=EVERY, trainable_only=True)


def trainer_for(base: str | Path, callbacks=()) -> Trainer:
    """The tiny GPT-2 read from ``base`` with adapters on q and v (SGD with momentum:
    optimizer state that must come back)."""
    return Trainer(
        lambda rngs: GPT2(CONFIG, rngs),
        optax.sgd(0.5, momentum=0.9),
        strategy=FSDP(8),
        loss_fn=loss_fn,
        lora=ADAPTERS,
        init_from=weights.Pretrained(base, gpt2_weight_map(CONFIG)),
        track_norms=False,
        callbacks=list(callbacks),
    )


def test_adapters_only_checkpoints_resume_onto_a_fresh_base_after_sigkill(tmp_path):
    base = tmp_path / "base.safetensors"
    safetensors.numpy.save_file(hf_weights(CONFIG, seed=3), str(base))
    script = SCRIPT.format(tests=str(Path(__file__).parent), steps=STEPS)
    directory = tmp_path / "ckpt"
    args = [sys.executable, "-c", script, str(base), str(directory), str(KILL_AT)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600)  # 8 devices, as here
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert OrbaxCheckpoint(directory, trainable_only=True).steps() == [2]
    held = (directory / "2" / "state" / "_METADATA").read_text()
    assert "lora_a" in held and "wte" not in held and "c_fc" not in held  # the base is not in it

    whole = RecordLosses()
    uninterrupted = trainer_for(base, [whole])
    uninterrupted.fit(batches(), max_steps=STEPS)
    after = RecordLosses()
    checkpoint = adapter_checkpoints(directory)
    resumed = trainer_for(base, [checkpoint, after])  # its base: read from the file again
    with pytest.warns(UserWarning, match="first 2 batches are read and discarded"):
        resumed.fit(batches(), max_steps=STEPS)
    assert checkpoint.restored_step == 2 and resumed.step == STEPS
    assert after.losses == whole.losses[2:]  # bitwise, step by step
    ours = flat_params(nnx.state(resumed.model, nnx.Param))
    theirs = flat_params(nnx.state(uninterrupted.model, nnx.Param))
    assert ours.keys() == theirs.keys() and any(k.endswith("lora_b") for k in ours)
    for key in ours:
        np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)
    file = safetensors.numpy.load_file(str(base))
    np.testing.assert_array_equal(ours["h/0/mlp/c_fc/kernel"], file["h.0.mlp.c_fc.weight"])
