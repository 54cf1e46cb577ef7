"""SampleCallback: samples while a run trains, in TensorBoard's text plugin, losses untouched."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import optax
import pytest
from flax import nnx
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from toy_models import RecordLosses

from nnx_spmd_trainer import FSDP, Trainer
from nnx_spmd_trainer.app.models.gpt import GPT, loss_fn
from nnx_spmd_trainer.callbacks import SampleCallback


def factory(rngs: nnx.Rngs) -> GPT:
    return GPT(
        vocab_size=32, seq_len=16, embed_dim=32, num_heads=4, ff_dim=64, num_layers=2,
        dropout_rate=0.1, rngs=rngs,
    )  # fmt: skip


def batches(n: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        tokens = rng.integers(0, 32, (8, 17), dtype=np.int32)
        out.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
    return out


def run(callbacks: list) -> list[float]:
    losses = RecordLosses()
    trainer = Trainer(
        factory, optax.adam(1e-2), strategy=FSDP(min_size=16), loss_fn=loss_fn,
        callbacks=[losses, *callbacks],
    )  # fmt: skip
    trainer.fit(batches(4), max_steps=4)
    return losses.losses


def test_samples_reach_tensorboards_text_plugin_and_the_losses_are_unchanged(
    tmp_path: Path,
) -> None:
    lines: list[str] = []
    sampler = SampleCallback(
        [[1, 2, 3], [4]], every_n_steps=2, max_new_tokens=3, logdir=tmp_path, print_fn=lines.append
    )
    with_samples = run([sampler])
    assert with_samples == run([])  # bitwise: the training state is only read
    assert [step for step, _ in sampler.samples] == [2, 4]
    assert len(lines) == 4 and lines[0].startswith("sample 0 at step 2: [1, 2, 3] -> ")
    (events_file,) = tmp_path.glob("events.out.tfevents.*")
    events = EventAccumulator(str(events_file), size_guidance={"tensors": 0})
    events.Reload()
    assert set(events.Tags()["tensors"]) == {"samples/0/text_summary", "samples/1/text_summary"}
    logged = events.Tensors("samples/1/text_summary")
    assert [e.step for e in logged] == [2, 4]
    last = " ".join(map(str, sampler.samples[-1][1].tokens[1]))
    assert logged[-1].tensor_proto.string_val[0].decode() == f"[4] → {last}"


def test_bad_settings_are_named() -> None:
    with pytest.raises(ValueError, match="every_n_steps=0"):
        SampleCallback([[1]], every_n_steps=0)
