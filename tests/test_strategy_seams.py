"""The strategy seams a new parallelism plugs into, alone and inside a Hybrid.

One toy strategy, ``SeqParallel``, uses each: it splits the batch's sequence
dimension (1) rather than its rows, constrains activations along it by
logical name while the step is traced (``trace_context``), and wraps the
step (``transform_step``). Its numbers are checked against plain optax on
one device (``toy_models.train_reference``), not against the library.
"""

import functools
import re
from typing import ClassVar

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from toy_models import Net, assert_params_match, classification_loss, train_reference

from nnx_spmd_trainer import (
    DataParallel,
    Hybrid,
    ShardingError,
    TensorParallel,
    Trainer,
)
from nnx_spmd_trainer.data import check_batch, place_batch, rows_multiple
from nnx_spmd_trainer.sharding import dimension_axes

ROWS, SEQ, DIN, HIDDEN, CLASSES = 4, 8, 16, 32, 8
#: The activation SeqNet constrains: (rows, sequence, hidden).
ACTIVATION = ("act_rows", "act_seq", "act_hidden")


class SeqNet(Net):
    """Net applied at every position of a sequence, its hidden activation constrained by
    logical names: a no-op unless a ``nnx.logical_axis_rules`` context maps them."""

    def __call__(self, x: jax.Array) -> jax.Array:
        h = nnx.relu(self.l1(x))
        h = nn.with_logical_constraint(h, ACTIVATION)
        return self.l3(nnx.relu(self.norm(self.l2(h))))


def make_seq_batches(n: int, rows: int = ROWS, seq: int = SEQ, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.normal(size=(rows, seq, DIN)).astype(np.float32),
            "y": rng.integers(0, CLASSES, size=(rows, seq)).astype(np.int32),
        }
        for _ in range(n)
    ]


class SeqParallel(DataParallel):
    """Sequence parallelism's data side: every seam a new strategy would use.

    - ``batch_sharding``: its axis splits dimension 1 (the sequence), not the rows;
    - ``trace_context``: ``act_seq`` activations are constrained along its axis;
    - ``transform_step``: the step is wrapped; transforms and traces are counted.
    """

    transforms: ClassVar[list[str]] = []
    traces: ClassVar[list[str]] = []

    def batch_sharding(self, batch, mesh, proposed=None):
        shardings = super().batch_sharding(batch, mesh, proposed)

        def one(sharding):
            rows = tuple(a for a in dimension_axes(sharding.spec, 1)[0] if a != self.axis)
            return NamedSharding(mesh, P(rows or None, self.axis))

        return jax.tree.map(one, shardings)

    def trace_context(self, mesh):
        return nnx.logical_axis_rules([("act_seq", self.axis)])

    def transform_step(self, step_fn):
        inner = super().transform_step(step_fn)
        type(self).transforms.append(inner.__name__)

        @functools.wraps(inner)
        def counted(*args):
            type(self).traces.append(inner.__name__)
            return inner(*args)

        return counted


@pytest.fixture
def counts():
    SeqParallel.transforms.clear()
    SeqParallel.traces.clear()
    return SeqParallel


@pytest.fixture
def lowered_text(tmp_path):
    """The StableHLO text of everything jitted from now on (JAX's own IR dump)."""
    previous = jax.config.values["jax_dump_ir_to"]
    jax.config.update("jax_dump_ir_to", str(tmp_path))
    try:
        yield lambda: "\n".join(p.read_text() for p in sorted(tmp_path.glob("*.mlir")))
    finally:
        jax.config.update("jax_dump_ir_to", previous)


def seq_trainer(strategy):
    return Trainer(
        lambda rngs: SeqNet(rngs),
        optax.sgd(0.1),
        strategy=strategy,
        loss_fn=classification_loss,
    )


def constraints_on_the_activation(text: str) -> list[str]:
    """The layouts of every sharding constraint on a (rows, seq, hidden) activation."""
    shape = rf"tensor<{ROWS}x{SEQ}x{HIDDEN}xf32>"
    return re.findall(rf"sharding_constraint %\S+ <@\w+, (\[.*?\])> : {shape}", text)


# -- the seams used alone and inside a Hybrid train like one device ---------------------
@pytest.mark.parametrize(
    "strategy",
    [SeqParallel(), Hybrid(SeqParallel(4), TensorParallel(2))],
    ids=["alone", "hybrid"],
)
def test_sequence_split_batch_trains_like_one_device(strategy, counts, lowered_text):
    batches = make_seq_batches(3)
    trainer = seq_trainer(strategy)
    trainer.fit(batches, max_steps=3)

    ref_params, _ = train_reference(lambda r: SeqNet(r), optax.sgd(0.1), batches)
    assert_params_match(trainer, ref_params)
    # trace_context: the model's logical constraint reached the compiled step.
    layouts = constraints_on_the_activation(lowered_text())
    assert layouts and set(layouts) == {'[{}, {"data"}, {}]'}, layouts
    # transform_step: asked for the train step once; the wrapper traced once, not per step.
    assert counts.transforms and counts.traces == counts.transforms


def test_without_the_context_the_logical_constraint_is_ignored(lowered_text):
    trainer = seq_trainer(Hybrid(DataParallel(4), TensorParallel(2)))
    trainer.fit(make_seq_batches(1), max_steps=1)
    assert constraints_on_the_activation(lowered_text()) == []


def test_place_batch_splits_the_sequence_dimension():
    strategy = Hybrid(SeqParallel(4), TensorParallel(2))
    mesh = strategy.make_mesh()
    batch = make_seq_batches(1)[0]
    placed = place_batch(batch, strategy.batch_sharding(batch, mesh))
    assert placed["x"].sharding.spec == P(None, "data")
    assert placed["x"].addressable_shards[0].data.shape == (ROWS, SEQ // 4, DIN)
    np.testing.assert_array_equal(np.asarray(placed["y"]), batch["y"])


# -- check_batch: every dimension against its own axes --------------------------------
def seq_shardings(batch, strategy=None):
    strategy = strategy or SeqParallel()
    return strategy.batch_sharding(batch, strategy.make_mesh())


def test_check_batch_checks_the_split_dimension_not_the_rows():
    batch = make_seq_batches(1, rows=3)[0]  # 3 rows: fine, the rows are not split
    check_batch(batch, seq_shardings(batch))
    odd = make_seq_batches(1, seq=6)[0]
    message = (
        r"batch leaf \['x'\] with shape \(4, 6, 16\): dimension 1 of global size 6 cannot be "
        r"split over the mesh axes \('data',\).*\{'data': 8\} \(8 parts\)\. Make dimension 1"
    )
    with pytest.raises(ShardingError, match=message):
        check_batch(odd, seq_shardings(odd))


def test_check_batch_counts_the_processes_on_the_split_dimension():
    # Two processes each feed half the sequence: 4 + 4 positions over 8 devices.
    half = make_seq_batches(1, seq=4)[0]
    check_batch(half, seq_shardings(half), data_shards=2)
    with pytest.raises(ShardingError, match=r"\(4, 4, 16\): dimension 1 of global size 4"):
        check_batch(half, seq_shardings(half))
    # The rows are not multiplied by the processes: 3 rows stay 3, and 2 microbatches fail.
    three = make_seq_batches(1, rows=3, seq=4)[0]
    with pytest.raises(ShardingError, match=r"global batch of 3 rows.*x 2 microbatches"):
        check_batch(three, seq_shardings(three), divisor=2, data_shards=2)


def test_check_batch_refuses_a_spec_longer_than_the_leaf():
    batch = {"x": np.zeros((4, 8), np.float32), "w": np.ones((4,), np.float32)}
    with pytest.raises(ShardingError, match=r"\['w'\] with shape \(4,\).*2 entries for 1"):
        check_batch(batch, seq_shardings(batch))


def test_rows_multiple_reads_only_the_rows():
    batch = make_seq_batches(1)[0]
    # The sequence split asks nothing of the rows but the microbatches...
    assert rows_multiple(seq_shardings(batch), divisor=2, data_shards=2) == 2
    assert rows_multiple(seq_shardings(batch)) == 1
    # ...where splitting the rows asks for its share of 8 devices x 2 microbatches.
    rows = seq_shardings(batch, DataParallel())
    assert rows_multiple(rows, divisor=2, data_shards=2) == 8
    assert rows_multiple(rows, divisor=2) == 16
