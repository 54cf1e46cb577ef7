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


def test_samples_and_their_speed_reach_mlflow_and_wandb(tmp_path: Path, monkeypatch) -> None:
    mlflow = pytest.importorskip("mlflow")
    wandb = pytest.importorskip("wandb")
    from nnx_spmd_trainer.callbacks import CSVLogger, MLflowLogger, WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    sampler = SampleCallback([[1, 2, 3], [4]], every_n_steps=2, max_new_tokens=3, print_fn=None)
    tracked = MLflowLogger(
        f"sqlite:///{tmp_path / 'mlflow.db'}", experiment="samples",
        artifact_location=str(tmp_path / "artifacts"),
    )  # fmt: skip
    offline = WandbLogger(project="samples", dir=tmp_path, settings=wandb.Settings(console="off"))
    run([sampler, tracked, offline, CSVLogger(tmp_path / "log.csv")])
    pages = {}
    for step, out in sampler.samples:
        texts = [" ".join(map(str, t)) for t in out.tokens]
        pages[step] = f"[1, 2, 3] -> {texts[0]!r}\n\n[4] -> {texts[1]!r}\n"
    client = mlflow.tracking.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    for step, page in pages.items():
        name = f"samples/step_{step:07d}.txt"
        got = Path(client.download_artifacts(tracked.run_id, name, str(tmp_path / "dl")))
        assert got.read_text() == page
        (wandb_file,) = (tmp_path / "wandb").glob(f"offline-run-*/files/{name}")
        assert wandb_file.read_text() == page
    history = client.get_metric_history(tracked.run_id, "sample/decode_tokens_per_s")
    speeds = {step: out.decode_tokens_per_second for step, out in sampler.samples}
    assert {m.step: m.value for m in history} == pytest.approx(speeds)
    assert all(v > 0 for v in speeds.values())
    with open(tmp_path / "log.csv") as f:
        header = f.readline()
    assert "sample/prefill_tokens_per_s" in header


def test_a_sampling_value_stands_for_the_three_keywords() -> None:
    from nnx_spmd_trainer import Sampling

    how = Sampling(temperature=0.7, top_k=3, top_p=0.9)
    given = SampleCallback([[1]], every_n_steps=1, sampling=how, seed=5)
    spelled = SampleCallback([[1]], every_n_steps=1, temperature=0.7, top_k=3, top_p=0.9, seed=5)
    assert given.options == spelled.options and spelled.sampling == how
    with pytest.raises(TypeError, match="either sampling= or temperature"):
        SampleCallback([[1]], every_n_steps=1, sampling=how, temperature=0.5)
    with pytest.raises(ValueError, match="top_p=1.5"):  # refused when built, not at step N
        SampleCallback([[1]], every_n_steps=1, top_p=1.5)
