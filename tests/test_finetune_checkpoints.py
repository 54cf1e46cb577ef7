"""Adapters-only checkpoints (``OrbaxCheckpoint(trainable_only=True)``): a LoRA run's steps
hold the adapters, the optimizer and RNG state but not the frozen base, restore onto a
freshly loaded base, and resume bitwise."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import optax
import pytest
import safetensors.numpy
from flax import nnx
from test_checkpoint import Crash, assert_bitwise
from test_weights_gpt2 import hf_weights
from toy_models import RecordLosses, flat_params

from nnx_spmd_trainer import FSDP, Trainer, weights
from nnx_spmd_trainer.app.models.gpt2_hf import GPT2, GPT2Config, gpt2_weight_map, loss_fn
from nnx_spmd_trainer.callbacks import CheckpointOfAnotherModel, MetricsLogger, OrbaxCheckpoint

CONFIG = GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2, dropout=0.1)
ADAPTED = ("q", "v")


def lora_gpt2(rngs: nnx.Rngs) -> GPT2:
    """The tiny GPT-2 with nnx.LoRA adapters (rank 2) on its attention's q and v."""
    model = GPT2(CONFIG, rngs)
    for block in model.h:
        for name in ADAPTED:
            base = getattr(block.attn, name)
            lora = nnx.LoRA(base.in_features, 2, base.out_features, base_module=base, rngs=rngs)
            setattr(block.attn, name, lora)
    return model


def lora_map() -> weights.WeightMap:
    plain = gpt2_weight_map(CONFIG)
    moved = re.compile(rf"(h/\d+/attn/(?:{'|'.join(ADAPTED)}))/(kernel|bias)")
    targets = {moved.sub(r"\1/base_module/\2", p): e for p, e in plain.targets.items()}
    return dataclasses.replace(plain, targets=targets)


def batches(n: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    rows = rng.integers(0, CONFIG.vocab_size, size=(n, 8, 9)).astype(np.int32)
    return [{"inputs": r[:, :-1], "targets": r[:, 1:]} for r in rows]


@pytest.fixture(scope="module")
def base_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("base") / "model.safetensors"
    safetensors.numpy.save_file(hf_weights(CONFIG, seed=5), str(path))
    return path


def trainer_for(base_file, callbacks=()) -> Trainer:
    return Trainer(
        lora_gpt2,
        optax.sgd(0.5, momentum=0.9),  # momentum: optimizer state that must come back
        strategy=FSDP(8),
        loss_fn=loss_fn,
        wrt=nnx.LoRAParam,
        init_from=weights.Pretrained(base_file, lora_map(), fresh=nnx.LoRAParam),
        track_norms=False,
        callbacks=[MetricsLogger(2), *callbacks],
    )


def params(trainer: Trainer) -> dict[str, np.ndarray]:
    return flat_params(nnx.state(trainer.model, nnx.Param))


def test_adapter_checkpoints_are_small_and_resume_bitwise_onto_a_fresh_base(tmp_path, base_file):
    data = batches(8)
    whole = RecordLosses()
    uninterrupted = trainer_for(base_file, [whole])
    uninterrupted.fit(data, max_steps=8)

    crashed = trainer_for(
        base_file, [OrbaxCheckpoint(tmp_path, save_every_n_steps=3, trainable_only=True), Crash(5)]
    )
    with pytest.raises(RuntimeError, match="simulated crash"):
        crashed.fit(data, max_steps=8)
    assert OrbaxCheckpoint(tmp_path, trainable_only=True).steps() == [3]
    meta = json.loads((tmp_path / "3" / "meta" / "metadata").read_text())
    assert meta["state_kept"] == "trainable"
    saved = json.loads((tmp_path / "3" / "state" / "_METADATA").read_text())
    names = [k for k in saved["tree_metadata"] if k.startswith("('model'")]
    # The adapters and the dropout RNG are in the step; the frozen base is not.
    assert any("lora_a" in k for k in names) and any("rngs" in k for k in names)
    assert not any("base_module" in k or "'wte'" in k or "c_fc" in k for k in names), names

    after = RecordLosses()
    checkpoint = OrbaxCheckpoint(tmp_path, save_every_n_steps=3, trainable_only=True)
    resumed = trainer_for(base_file, [checkpoint, after])  # its base: read from the file
    with pytest.warns(UserWarning, match="first 3 batches are read and discarded"):
        resumed.fit(data, max_steps=8)
    assert checkpoint.restored_step == 3 and resumed.step == 8
    assert after.losses == whole.losses[3:]  # bitwise, step by step
    assert_bitwise(params(resumed), params(uninterrupted))
    base = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))
    file = safetensors.numpy.load_file(str(base_file))
    np.testing.assert_array_equal(
        np.asarray(resumed.model.h[0].mlp.c_fc.kernel[...]), file["h.0.mlp.c_fc.weight"]
    )
    assert (
        flat_params(nnx.state(resumed.model, base)).keys()
        == flat_params(nnx.state(uninterrupted.model, base)).keys()
    )

    # A whole-state reader is told the step is of another shape of state, not damaged.
    with pytest.raises(CheckpointOfAnotherModel, match="only in this model"):
        trainer_for(base_file, [OrbaxCheckpoint(tmp_path)]).fit(data, max_steps=8)
