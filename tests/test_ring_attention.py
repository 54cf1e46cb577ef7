"""SequenceParallel(..., attention="ring"): ring attention, exact, a ring in the compiled step.

The shipped GPT trained through ``Trainer.fit`` with ring attention is checked
against plain optax on one device (test_sequence_parallel's reference and
helpers), and a checkpoint moves between the ring and the all-gather form.
"""

import re

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_sequence_parallel import (  # noqa: F401 (reference: the module fixture)
    SEQ,
    STEPS,
    gpt_loss,
    reference,
    reference_attention,
    tiny_gpt,
    token_batches,
)
from test_sequence_parallel_checkpoints import host
from toy_models import RecordLosses, assert_params_match

from nnx_spmd_trainer import (
    FSDP,
    DataParallel,
    Hybrid,
    Plan,
    SequenceParallel,
    TensorParallel,
    Trainer,
)
from nnx_spmd_trainer.callbacks import LambdaCallback, OrbaxCheckpoint
from nnx_spmd_trainer.nn.attention import attention_form, causal_attention
from nnx_spmd_trainer.nn.ring_attention import ring_blocks


def ring(n):
    return SequenceParallel(n, attention="ring")


def compiled_step(trainer, batch):
    """The HLO text of the train step the trainer ran (as tests/test_plan_report.py), lowered
    under the trainer's mesh as the trainer runs it (``length_axes`` reads the mesh)."""
    placed = trainer.placement.place(batch)
    ran, new = trainer._loop.cached_step("train", placed)
    assert not new  # the jitted step the trainer ran, from the plan's cache
    args = (trainer.run.objects().arrays(), trainer.metric_log.train, placed)
    with jax.set_mesh(trainer.mesh):
        return ran.lower(*args).compile().as_text()


def kv_gathers(text):
    """The all-gathers whose result is a 4-D (rows, whole sequence, heads, head_dim) array:
    keys or values gathered along `seq` (parameters gathered by FSDP have other shapes)."""
    result = re.compile(rf"= \w+\[\d+,{SEQ},\d+,\d+\]\S* all-gather(-start)?\(")
    return [line.strip() for line in text.splitlines() if result.search(line)]


# -- the attention alone: forward and gradient, both orders ------------------------------
@pytest.mark.parametrize("balanced", [True, False], ids=["balanced", "contiguous"])
def test_ring_attention_and_its_gradient_equal_one_device(balanced):
    from nnx_spmd_trainer.nn.ring_attention import ring_attention

    strategy = Hybrid(DataParallel(2), SequenceParallel(4))
    mesh = strategy.make_mesh()
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(2, 16, 2, 8)).astype(np.float32) for _ in range(3))

    def loss(attend):
        return lambda q, k, v: (attend(q, k, v) * np.cos(np.arange(8))).sum()

    def attend(q, k, v):
        return ring_attention(q, k, v, "seq", balanced=balanced)

    split = NamedSharding(mesh, P("data", "seq"))
    with jax.set_mesh(mesh):
        args = [jax.device_put(x, split) for x in (q, k, v)]
        out = jax.jit(attend)(*args)
        grads = jax.jit(jax.grad(loss(attend), argnums=(0, 1, 2)))(*args)
    np.testing.assert_allclose(np.asarray(out), reference_attention(q, k, v), atol=1e-5)
    want = jax.grad(loss(lambda *a: causal_attention(*a)), argnums=(0, 1, 2))(q, k, v)
    for got, expected in zip(grads, want, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-5)


def test_the_balanced_order_evens_out_the_causal_work():
    for n in (2, 4, 8):
        counts = ring_blocks(n)
        assert max(counts) <= 1.1 * min(counts)  # within 10% (here: equal, 2n + 1)
        assert sum(counts) == sum(ring_blocks(n, balanced=False)) == 2 * n * (2 * n + 1) // 2


def test_the_form_is_checked():
    with pytest.raises(ValueError, match=r"attention='ringg'.*\('all_gather', 'ring'\)"):
        SequenceParallel(4, attention="ringg")
    with pytest.raises(ValueError, match="choose one of"), attention_form("nope"):
        pass
    assert (
        repr(Hybrid(FSDP(2), ring(4))) == "Hybrid(FSDP(2), SequenceParallel(4, attention='ring'))"
    )


# -- trained through Trainer.fit, it equals one device --------------------------------------
@pytest.mark.parametrize(
    "strategy",
    [
        ring(8),
        Hybrid(FSDP(2), ring(4)),
        Hybrid(DataParallel(2), ring(2), TensorParallel(2)),
    ],
    ids=["seq8", "fsdp2-seq4", "dp2-seq2-tp2"],
)
def test_gpt_with_ring_attention_trains_like_one_device(strategy, reference):  # noqa: F811
    batches = token_batches(STEPS)
    recorder = RecordLosses()
    trainer = Trainer(
        tiny_gpt, optax.sgd(0.5), strategy=strategy, loss_fn=gpt_loss, callbacks=[recorder]
    )
    trainer.fit(batches, max_steps=STEPS)

    ref_params, ref_losses = reference
    np.testing.assert_allclose(recorder.losses, ref_losses, rtol=1e-5, atol=1e-5)
    assert_params_match(trainer, ref_params)
    # The step passes keys and values round the ring and gathers none along `seq`.
    text = compiled_step(trainer, batches[0])
    assert "collective-permute" in text
    assert kv_gathers(text) == []


# -- checkpoints move between the forms exactly ----------------------------------------------
def test_a_checkpoint_moves_between_ring_and_all_gather(tmp_path, reference):  # noqa: F811
    batches, save_at = token_batches(STEPS), 2
    whole = RecordLosses()
    writer = Trainer(
        tiny_gpt,
        optax.sgd(0.5),
        strategy=Hybrid(FSDP(2), ring(4)),
        loss_fn=gpt_loss,
        callbacks=[OrbaxCheckpoint(tmp_path, save_every_n_steps=save_at), whole],
    )
    writer.fit(batches[:save_at], max_steps=save_at)
    saved = jax.device_get(writer.state)

    restored: list = []
    after = RecordLosses()
    checkpoint = OrbaxCheckpoint(tmp_path / "moved", restore=tmp_path / str(save_at))
    moved = Trainer(
        tiny_gpt,
        optax.sgd(0.5),
        strategy=Hybrid(FSDP(2), SequenceParallel(4)),  # the all-gather form goes on
        loss_fn=gpt_loss,
        callbacks=[
            checkpoint,
            LambdaCallback(  # what on_fit_start restored, before training donates it
                on_train_begin=lambda logs: restored.append(jax.device_get(moved.state))
            ),
            after,
        ],
    )
    with pytest.warns(UserWarning, match="read and discarded"):
        moved.fit(batches, max_steps=STEPS)
    assert checkpoint.restored_step == save_at
    for want, got in zip(jax.tree.leaves(saved), jax.tree.leaves(restored[0]), strict=True):
        np.testing.assert_array_equal(host(got), host(want))
    ref_params, ref_losses = reference
    np.testing.assert_allclose(whole.losses + after.losses, ref_losses, rtol=1e-5, atol=1e-5)
    assert_params_match(moved, ref_params)


# -- the command line (the default job's run: tests/test_sequence_parallel_cli.py) ----------
def test_the_config_key_sets_the_seq_members_form():
    from nnx_spmd_trainer.app import tasks

    assert tasks.parse_strategy("fsdp=2,seq=4", "ring") == Hybrid(FSDP(2), ring(4))
    assert tasks.parse_strategy("seq=8") == SequenceParallel(8)  # all-gather by default
    with pytest.raises(tasks.ConfigError, match=r"config.sequence_attention='rign'; use one of"):
        tasks.parse_strategy("seq=8", "rign")


# -- Plan.report says which form is in force --------------------------------------------------
@pytest.mark.parametrize(
    ("form", "says"),
    [
        ("ring", r"attention ring .*collective-permute x[1-9]"),
        ("all_gather", r"attention all_gather .*all-gather x[1-9]"),
    ],
)
def test_the_plan_report_names_the_form_and_its_collective(form, says):
    strategy = Hybrid(FSDP(2), SequenceParallel(4, attention=form))
    plan = Plan(tiny_gpt, optax.sgd(0.5), strategy=strategy, loss_fn=gpt_loss)
    batch = token_batches(1)[0]
    (line,) = [s for s in str(plan.report(batch)).splitlines() if "sequence:" in s]
    assert re.search(rf"sequence: split over 'seq' \(4 devices\), {says}", line), line
    # kv_gathers sees the all-gather form's keys and values, and none in the ring's.
    with jax.set_mesh(plan.mesh):
        gathered = kv_gathers(plan.lower(batch).compile().as_text())
    assert bool(gathered) == (form == "all_gather")
