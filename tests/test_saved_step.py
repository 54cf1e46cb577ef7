"""Issue 55: a compiled train step saved beside its plan and loaded for a later run on
that hardware (jax's serialize_executable), a record of what it was compiled by and
for, and a mismatch refused."""

from __future__ import annotations

import importlib.util
import json

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from nnx_spmd_trainer import FSDP, Hybrid, Plan, TensorParallel, Trainer
from nnx_spmd_trainer.app.models import GPT, gpt
from nnx_spmd_trainer.planner.saved_step import RECORD, SavedStepMismatch, load_step, save_step


def tiny_gpt(rngs):
    return GPT(
        vocab_size=64, seq_len=16, embed_dim=32, num_heads=4, ff_dim=64, num_layers=1,
        dropout_rate=0.0, rngs=rngs,
    )  # fmt: skip


STRATEGY = Hybrid(FSDP(4, min_size=16), TensorParallel(2))


def batches(n=3):
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        window = rng.integers(0, 64, size=(8, 17), dtype=np.int32)
        out.append({"inputs": window[:, :-1], "targets": window[:, 1:]})
    return out


def trainer():
    return Trainer(tiny_gpt, optax.adamw(1e-2), strategy=STRATEGY, loss_fn=gpt.loss_fn,
                   log_every_n_steps=1)  # fmt: skip


def test_a_saved_step_runs_a_later_run_bitwise_without_compiling_it(tmp_path):
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batches()[0])
    save_step(trainer(), shapes, tmp_path / "step", norms=True)  # a Trainer tracks norms
    record = json.loads((tmp_path / "step" / RECORD).read_text())
    assert record["versions"]["jax"] == jax.__version__ and record["platform"] == "cpu"
    assert record["mesh"] == {"fsdp": 4, "model": 2} and record["devices"] == 8

    later = trainer()
    loaded = load_step(later, tmp_path / "step")
    compiled_before = later.plan.steps.count
    history = later.fit(batches(), max_steps=3).history
    assert later.plan.steps.count == compiled_before  # the train step was not compiled
    # the loaded program is the one that ran: a run that compiles its own ends the same
    itself = trainer()
    expected = itself.fit(batches(), max_steps=3).history
    assert history["train/loss"] == expected["train/loss"]
    for ours, theirs in zip(jax.tree.leaves(nnx.state(later.model, nnx.Param)),
                            jax.tree.leaves(nnx.state(itself.model, nnx.Param)),
                            strict=True):  # fmt: skip
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    assert isinstance(loaded, jax.stages.Compiled)


def test_a_step_saved_by_another_jax_or_for_other_chips_is_refused_naming_it(tmp_path):
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batches()[0])
    plan = Plan(tiny_gpt, optax.adamw(1e-2), strategy=STRATEGY, loss_fn=gpt.loss_fn)
    folder = save_step(plan, shapes, tmp_path / "step")
    record = json.loads((folder / RECORD).read_text())
    record["versions"]["jax"] = "0.0.1"
    (folder / RECORD).write_text(json.dumps(record))
    with pytest.raises(SavedStepMismatch, match=r"versions .*'jax': '0.0.1'.*Compile it again"):
        load_step(plan, folder)
    with pytest.raises(SavedStepMismatch, match=r"no saved step there"):
        load_step(plan, tmp_path / "nothing")
    with pytest.raises(TypeError, match=r"dict of arrays"):
        save_step(plan, [shapes], tmp_path / "list")


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu")
def test_a_step_compiled_for_tpu_chips_that_are_not_here_is_saved_and_refused_here(tmp_path):
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batches()[0])
    on_chips = Plan(tiny_gpt, optax.adamw(1e-2), strategy=STRATEGY, loss_fn=gpt.loss_fn,
                    target="v5e:2x4")  # fmt: skip
    folder = save_step(on_chips, shapes, tmp_path / "step")
    record = json.loads((folder / RECORD).read_text())
    assert (record["platform"], record["device_kind"]) == ("tpu", "TPU v5 lite")
    assert "libtpu" in record["versions"] and (folder / "train_step.xla").stat().st_size > 0
    here = Plan(tiny_gpt, optax.adamw(1e-2), strategy=STRATEGY, loss_fn=gpt.loss_fn)
    with pytest.raises(SavedStepMismatch, match=r"platform 'tpu' \(here 'cpu'\)"):
        load_step(here, folder)
