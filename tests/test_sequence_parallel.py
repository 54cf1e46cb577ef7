"""SequenceParallel: the sequence split over a mesh axis, alone and in a Hybrid, exact.

The shipped GPT (its attention is ``nnx_spmd_trainer.nn.attention.causal_attention``)
trained through ``Trainer.fit`` is checked against plain optax on one device
(``toy_models.train_reference``), not against the library.
"""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from toy_models import RecordLosses, assert_params_match, train_reference

from nnx_spmd_trainer import (
    FSDP,
    DataParallel,
    DataShard,
    Hybrid,
    SequenceParallel,
    ShardingError,
    TensorParallel,
    Trainer,
)
from nnx_spmd_trainer.app import tasks
from nnx_spmd_trainer.app.models import GPT, gpt
from nnx_spmd_trainer.nn.attention import causal_attention, length_axes
from nnx_spmd_trainer.strategies.base import context_rules

VOCAB, SEQ, ROWS, STEPS = 16, 16, 4, 3
TINY = dict(seq_len=SEQ, embed_dim=16, num_heads=4, ff_dim=32, num_layers=1)


def tiny_gpt(rngs):
    return GPT(vocab_size=VOCAB, dropout_rate=0.0, rngs=rngs, **TINY)


def token_batches(n, rows=ROWS, seq=SEQ, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        window = rng.integers(0, VOCAB, size=(rows, seq + 1), dtype=np.int32)
        out.append({"inputs": window[:, :-1], "targets": window[:, 1:]})
    return out


def gpt_loss(model, batch):
    return gpt.loss_fn(model, batch)


# -- trained through Trainer.fit, it equals one device ------------------------------------
@pytest.fixture(scope="module")
def reference():
    """Plain optax on one device, the same for every layout: computed once."""
    return train_reference(tiny_gpt, optax.sgd(0.5), token_batches(STEPS), loss_fn=gpt_loss)


# Issue 20's four layouts, each with the spec its (rows, sequence) inputs get.
LAYOUTS = pytest.mark.parametrize(
    ("strategy", "spec"),
    [
        (SequenceParallel(8), P(None, "seq")),
        (Hybrid(FSDP(2), SequenceParallel(4)), P("fsdp", "seq")),
        (Hybrid(SequenceParallel(4), TensorParallel(2)), P(None, "seq")),
        (Hybrid(DataParallel(2), SequenceParallel(2), TensorParallel(2)), P("data", "seq")),
    ],
    ids=["seq8", "fsdp2-seq4", "seq4-tp2", "dp2-seq2-tp2"],
)


@LAYOUTS
def test_gpt_trains_like_one_device(strategy, spec, reference):
    batches = token_batches(STEPS)
    recorder = RecordLosses()
    # SGD: Adam would amplify the float noise of the key bias's zero gradient (PITFALLS).
    trainer = Trainer(
        tiny_gpt, optax.sgd(0.5), strategy=strategy, loss_fn=gpt_loss, callbacks=[recorder]
    )
    trainer.fit(batches, max_steps=STEPS)

    ref_params, ref_losses = reference
    np.testing.assert_allclose(recorder.losses, ref_losses, rtol=1e-5, atol=1e-5)
    assert_params_match(trainer, ref_params)
    # The batch is split along its sequence; the rows as the other members say.
    placed = trainer.placement.place(batches[0])
    seq_parts = dict(trainer.mesh.shape)["seq"]
    rows_parts = len(trainer.mesh.devices.flat) // seq_parts
    rows_parts //= dict(trainer.mesh.shape).get("model", 1)
    for leaf in placed.values():
        assert leaf.sharding.spec == spec
        assert leaf.addressable_shards[0].data.shape == (ROWS // rows_parts, SEQ // seq_parts)
    # Parameters are replicated along the seq axis.
    for _, variable in nnx.to_flat_state(nnx.state(trainer.model, nnx.Param)):
        assert "seq" not in jax.tree.leaves(tuple(variable.get_value().sharding.spec))


# -- the attention ----------------------------------------------------------------------
def reference_attention(q, k, v):
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    scores = np.where(np.tril(np.ones((q.shape[1], k.shape[1]), bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", weights, v)


def test_attention_split_along_the_sequence_is_exact_and_gathers_keys():
    strategy = Hybrid(DataParallel(2), SequenceParallel(4))
    mesh = strategy.make_mesh()
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(2, SEQ, 2, 8)).astype(np.float32) for _ in range(3))
    split = NamedSharding(mesh, P("data", "seq"))
    seen = []

    def attend(q, k, v):
        with strategy.trace_context(mesh):
            seen.append(length_axes())
            return causal_attention(q, k, v)

    with jax.set_mesh(mesh):
        jitted = jax.jit(attend, in_shardings=split, out_shardings=split)
        args = [jax.device_put(x, split) for x in (q, k, v)]
        out = jitted(*args)
        text = jitted.lower(*args).compile().as_text()
    assert seen == [("seq",)]
    np.testing.assert_allclose(np.asarray(out), reference_attention(q, k, v), atol=1e-5)
    assert "all-gather" in text
    # Outside the strategy's context (no rule for "length"): ordinary attention.
    assert length_axes() == ()
    np.testing.assert_allclose(causal_attention(q, k, v), reference_attention(q, k, v), atol=1e-5)


def test_trace_context_maps_length_and_an_enclosing_rule_wins():
    mesh = SequenceParallel(8).make_mesh()
    with SequenceParallel(8).trace_context(mesh):
        rules = dict(context_rules())
    assert rules == {"length": "seq", "seq": "seq"}
    enclosing = nnx.logical_axis_rules([("length", None), ("embed", "fsdp")])
    with enclosing, SequenceParallel(8).trace_context(mesh):
        rules = dict(context_rules())
    assert rules == {"length": None, "embed": "fsdp", "seq": "seq"}


# -- batch placement and which rows a process feeds ---------------------------------------
def test_per_row_leaves_keep_the_rows_layout():
    strategy = Hybrid(FSDP(2), SequenceParallel(4))
    batch = {**token_batches(1)[0], "mask": np.ones(ROWS, np.float32)}
    shardings = strategy.batch_sharding(batch, strategy.make_mesh())
    assert shardings["inputs"].spec == P("fsdp", "seq")
    assert shardings["mask"].spec == P("fsdp")


def simulated(strategy, processes):
    """Devices split in order over ``processes`` hosts; every process's DataShard."""
    mesh = strategy.make_mesh()
    ids = (np.arange(mesh.size) // (mesh.size // processes)).reshape(mesh.devices.shape)
    return [tuple(strategy.data_shard(mesh, p, process_ids=ids)) for p in range(processes)]


@pytest.mark.parametrize(
    ("strategy", "processes", "shards"),
    [
        # The sequence over both processes: both feed the same (whole) rows.
        (SequenceParallel(8), 2, [(0, 1), (0, 1)]),
        (Hybrid(SequenceParallel(4), TensorParallel(2)), 4, [(0, 1)] * 4),
        # Rows over processes: each feeds its rows, whole sequences.
        (Hybrid(FSDP(2), SequenceParallel(4)), 2, [(0, 2), (1, 2)]),
        # Processes along the sequence axis share rows.
        (Hybrid(FSDP(2), SequenceParallel(4)), 8, [(i // 4, 2) for i in range(8)]),
        (
            Hybrid(DataParallel(2), SequenceParallel(2), TensorParallel(2)),
            4,
            [(0, 2), (0, 2), (1, 2), (1, 2)],
        ),
    ],
)
def test_processes_holding_chunks_of_the_same_rows_feed_the_same_rows(strategy, processes, shards):
    assert simulated(strategy, processes) == shards
    assert strategy.data_shard(strategy.make_mesh()) == DataShard(0, 1)


# -- errors that name the fix -------------------------------------------------------------
def test_a_sequence_the_axis_does_not_divide_is_refused():
    strategy = Hybrid(FSDP(2), SequenceParallel(4))
    batch = token_batches(1, seq=6)[0]
    message = (
        r"SequenceParallel\(4\): batch leaf \['inputs'\] has shape \(4, 6\); its sequence "
        r"\(dimension 1\) of length 6 cannot be split over mesh axis 'seq' of 4 devices.*"
        r"Use a sequence length divisible by 4"
    )
    with pytest.raises(ShardingError, match=message):
        strategy.batch_sharding(batch, strategy.make_mesh())
    trainer = Trainer(tiny_gpt, optax.sgd(0.1), strategy=strategy, loss_fn=gpt_loss)
    with pytest.raises(ShardingError, match=message):
        trainer.fit([batch], max_steps=1)


def test_a_batch_without_a_sequence_dimension_is_refused():
    batch = {"x": np.zeros(8, np.float32), "y": np.zeros(8, np.int32)}
    message = (
        r"SequenceParallel\(8\): the batch has no sequence dimension \(leaf shapes "
        r"\{\"\['x'\]\": \(8,\), \"\['y'\]\": \(8,\)\}\).*Feed \(rows, sequence, \.\.\.\) arrays"
    )
    with pytest.raises(ShardingError, match=message):
        SequenceParallel(8).batch_sharding(batch, SequenceParallel(8).make_mesh())


def test_repr_and_exports():
    import nnx_spmd_trainer

    assert repr(Hybrid(FSDP(2), SequenceParallel(4))) == "Hybrid(FSDP(2), SequenceParallel(4))"
    assert repr(SequenceParallel(axis="cp")) == "SequenceParallel(axis='cp')"
    assert nnx_spmd_trainer.SequenceParallel is SequenceParallel
    assert "SequenceParallel" in nnx_spmd_trainer.__all__


# -- the command line -----------------------------------------------------------------------
def test_mesh_specs_name_the_sequence_axis():
    assert tasks.parse_strategy("fsdp=2,seq=4") == Hybrid(FSDP(2), SequenceParallel(4))
    assert tasks.parse_strategy("seq=8") == tasks.parse_strategy("sp=8") == SequenceParallel(8)
    with pytest.raises(tasks.ConfigError, match=r"seq \(or sp\)"):
        tasks.parse_strategy("context=8")


# The default job from the command line: tests/test_sequence_parallel_cli.py.
