"""Hybrid asks every member every question; reprs, equality, and which rows each process feeds."""

import dataclasses
from typing import ClassVar

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from toy_models import (
    Net,
    RecordLosses,
    assert_params_match,
    classification_loss,
    make_batches,
    train_reference,
)

from nnx_spmd_trainer import (
    FSDP,
    AxisStrategy,
    DataParallel,
    DataShard,
    ExpertParallel,
    Hybrid,
    ShardingError,
    Strategy,
    TensorParallel,
    Trainer,
)


def _is_variable(x):
    return isinstance(x, nnx.Variable)


class ReplicateBias(FSDP):
    """Overrides question 1: every leaf whose path ends in "bias" is replicated."""

    def state_shardings(self, abstract_state, mesh, proposed=None):
        shardings = super().state_shardings(abstract_state, mesh, proposed)

        def one(path, sharding):
            bias = str(getattr(path[-1], "key", path[-1])) == "bias"
            return NamedSharding(mesh, P()) if bias else sharding

        return jax.tree_util.tree_map_with_path(one, shardings)


class BatchOverModel(TensorParallel):
    """Overrides question 2: the batch is split over the model axis too."""

    def batch_sharding(self, batch, mesh, proposed=None):
        shardings = super().batch_sharding(batch, mesh, proposed)

        def one(sharding):
            first = sharding.spec[0] if len(sharding.spec) else None
            axes = () if first is None else (first,) if isinstance(first, str) else first
            return NamedSharding(mesh, P((*axes, self.axis), *sharding.spec[1:]))

        return jax.tree.map(one, shardings)


class CountCompiles(TensorParallel):
    """Overrides question 3: wraps the step, counting compilations and traces."""

    compiles: ClassVar[list[str]] = []
    traces: ClassVar[list[str]] = []

    def compile_step(self, step_fn, *, jit=jax.jit, **layout):
        def counted(*args):
            type(self).traces.append(step_fn.__name__)
            return step_fn(*args)

        type(self).compiles.append(step_fn.__name__)
        return super().compile_step(counted, jit=jit, **layout)


def build(strategy, **kwargs):
    return Trainer(
        lambda rngs: Net(rngs),
        optax.adam(1e-2),
        strategy=strategy,
        loss_fn=classification_loss,
        **kwargs,
    )


def flat_specs(tree):
    return {
        "/".join(map(str, path)): variable.get_value().sharding.spec
        for path, variable in nnx.to_flat_state(tree)
    }


# -- each question overridden by a member takes effect inside a Hybrid -----------------
def test_member_overrides_state_and_batch_inside_hybrid_and_still_trains():
    strategy = Hybrid(ReplicateBias(4, min_size=64), BatchOverModel(2))
    batches = make_batches(2)
    recorder = RecordLosses()
    trainer = build(strategy, callbacks=[recorder])
    specs = flat_specs(trainer.state)
    biases = {k: s for k, s in specs.items() if k.endswith("bias")}
    assert len(biases) == 4 * 3  # l1-l3 and norm: the parameter, mu and nu
    assert all(spec == P() for spec in biases.values()), biases
    # Everything else keeps the joint resolution (FSDP refinement and TP annotations).
    assert specs["model/l1/kernel"] == P("fsdp", "model")
    assert specs["model/l2/kernel"] == P("model", "fsdp")
    assert specs["model/l3/kernel"] == P("fsdp")
    assert specs["optimizer/opt_state/0/mu/l1/kernel"] == P("fsdp", "model")

    placed = trainer.placement.place(batches[0])
    assert placed["x"].sharding.spec == P(("fsdp", "model"))
    assert placed["x"].sharding.shard_shape(placed["x"].shape) == (2, 16)

    trainer.fit(batches, max_steps=2)
    ref_params, ref_losses = train_reference(lambda r: Net(r), optax.adam(1e-2), batches)
    np.testing.assert_allclose(recorder.losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert_params_match(trainer, ref_params)


def test_member_compile_step_wraps_the_trainers_step():
    CountCompiles.compiles.clear()
    CountCompiles.traces.clear()
    trainer = build(Hybrid(FSDP(4, min_size=64), CountCompiles(2)))
    trainer.fit(make_batches(3), max_steps=3)
    assert len(CountCompiles.compiles) == 1  # the train step, compiled once
    trainer.log_schedule.request_log_every(2)  # a log point: the variant with norms, compiled once
    trainer.fit(make_batches(3), max_steps=6)
    assert len(CountCompiles.compiles) == 2
    assert CountCompiles.traces == CountCompiles.compiles  # traced once, not per step
    assert trainer.step == 6


def test_hybrid_batch_sharding_without_override_leaves_model_axis_replicated():
    mesh = Hybrid(FSDP(4), TensorParallel(2)).make_mesh()
    batch = {"x": np.zeros((16, 3), np.float32)}
    assert Hybrid(FSDP(4), TensorParallel(2)).batch_sharding(batch, mesh)["x"].spec == P(("fsdp",))
    got = Hybrid(FSDP(4), BatchOverModel(2)).batch_sharding(batch, mesh)["x"].spec
    assert got == P(("fsdp", "model"))


class Tag(DataParallel):
    """Records what it was proposed and adds its name: shows the chain's order."""

    seen: ClassVar[list[tuple[str, object]]] = []

    def state_shardings(self, abstract_state, mesh, proposed=None):
        type(self).seen.append((f"state:{self.axis}", proposed))
        return {**proposed, self.axis: True}

    def batch_sharding(self, batch, mesh, proposed=None):
        type(self).seen.append((f"batch:{self.axis}", proposed))
        return (*proposed, self.axis)

    def compile_step(self, step_fn, *, jit=jax.jit, **layout):
        type(self).seen.append((f"compile:{self.axis}", layout["in_shardings"]))
        return super().compile_step(step_fn, jit=jit, **{**layout, "in_shardings": self.axis})


def test_members_are_asked_in_order_each_given_the_answer_so_far():
    Tag.seen.clear()
    strategy = Hybrid(Tag(1, axis="a"), Tag(1, axis="b"))
    mesh = strategy.make_mesh(jax.devices()[:1])
    assert strategy.state_shardings(None, mesh, proposed={}) == {"a": True, "b": True}
    assert strategy.batch_sharding(None, mesh, proposed=()) == ("a", "b")

    def fake_jit(fn, **layout):
        return ("compiled", fn, layout)

    compiled = strategy.compile_step(abs, in_shardings="joint", out_shardings=None, jit=fake_jit)
    layout = {"in_shardings": "b", "out_shardings": None, "donate_argnums": ()}
    assert compiled == ("compiled", abs, layout)  # the given jit is innermost
    order = ["state:a", "state:b", "batch:a", "batch:b", "compile:a", "compile:b"]
    assert [name for name, _ in Tag.seen] == order
    proposals = dict(Tag.seen)
    assert proposals["state:b"] == {"a": True}
    assert proposals["batch:b"] == ("a",)
    assert proposals["compile:a"] == "joint"  # the first member is outermost
    assert proposals["compile:b"] == "a"


# -- reprs, equality, finality ------------------------------------------------------
@pytest.mark.parametrize(
    ("strategy", "text"),
    [
        (DataParallel(), "DataParallel()"),
        (FSDP(4), "FSDP(4)"),
        (FSDP(4, min_size=1), "FSDP(4, min_size=1)"),
        (FSDP(min_size=1024), "FSDP()"),
        (TensorParallel(2, axis="tp"), "TensorParallel(2, axis='tp')"),
        (DataParallel(rules=(("embed", "data"),)), "DataParallel(rules=(('embed', 'data'),))"),
        (Hybrid(FSDP(4), TensorParallel(2)), "Hybrid(FSDP(4), TensorParallel(2))"),
        (
            Hybrid(DataParallel(2), FSDP(2), rules=(("embed", None),)),
            "Hybrid(DataParallel(2), FSDP(2), rules=(('embed', None),))",
        ),
        (
            Hybrid(DataParallel(2), FSDP(2), TensorParallel(2)),
            "Hybrid(DataParallel(2), FSDP(2), TensorParallel(2))",
        ),
        (
            Hybrid(ReplicateBias(4), TensorParallel(2)),
            "Hybrid(ReplicateBias(4), TensorParallel(2))",
        ),
    ],
)
def test_repr_shows_what_changes_the_answers(strategy, text):
    assert repr(strategy) == text


def test_equality_and_hashing():
    assert Hybrid(FSDP(4), TensorParallel(2)) == Hybrid(FSDP(4), TensorParallel(2))
    assert hash(Hybrid(FSDP(4), TensorParallel(2))) == hash(Hybrid(FSDP(4), TensorParallel(2)))
    assert Hybrid(FSDP(4), TensorParallel(2)) != Hybrid(TensorParallel(2), FSDP(4))
    assert Hybrid(FSDP(4)) != Hybrid(FSDP(4), rules=(("embed", None),))
    assert Hybrid(FSDP(4)) != Hybrid(ReplicateBias(4))
    assert FSDP(4) != ReplicateBias(4)
    assert FSDP(4, min_size=1) != FSDP(4)
    assert {Hybrid(FSDP(4), TensorParallel(2)): 1}[Hybrid(FSDP(4), TensorParallel(2))] == 1


def test_hybrid_is_final_and_strategy_abstract():
    with pytest.raises(TypeError, match="Hybrid is final.*Subclass the member"):

        class MyHybrid(Hybrid):  # noqa: F841
            pass

    with pytest.raises(TypeError, match="abstract"):
        Strategy()  # type: ignore[abstract]
    with pytest.raises(TypeError, match="names no mesh axis"):
        AxisStrategy(2)
    with pytest.raises(TypeError, match="must be strategies"):
        Hybrid(FSDP(4), "model")  # type: ignore[arg-type]


@pytest.mark.parametrize("min_size", ["1024", -1, 1.5, True])
@pytest.mark.parametrize("strategy", [FSDP, TensorParallel, ExpertParallel])
def test_a_min_size_that_is_no_count_of_elements_is_refused_where_it_is_given(strategy, min_size):
    with pytest.raises(ValueError, match=rf"{strategy.__name__}\(min_size=.*int >= 0"):
        strategy(2, min_size=min_size)
    assert strategy(2, min_size=0).min_size == 0  # every leaf counts: allowed


@dataclasses.dataclass(frozen=True, repr=False)
class Stages(AxisStrategy):
    """A new single-axis strategy: only its usual axis and batch role."""

    usual_axis: ClassVar[str] = "stage"
    shards_batch: ClassVar[bool] = False
    axis: str = usual_axis


def test_new_axis_strategy_composes():
    strategy = Hybrid(DataParallel(4), Stages(2, axis="pp"))
    assert strategy.mesh_axes() == (("data", 4), ("pp", 2))
    assert strategy.batch_axes() == ("data",)
    assert dict(strategy.logical_rules())["stage"] == "pp"  # the usual name still applies
    assert repr(strategy) == "Hybrid(DataParallel(4), Stages(2, axis='pp'))"


# -- question 4: which rows each process feeds --------------------------------------
def simulated(strategy, processes):
    """Devices split in order over ``processes`` hosts; every process's DataShard."""
    mesh = strategy.make_mesh()
    ids = (np.arange(mesh.size) // (mesh.size // processes)).reshape(mesh.devices.shape)
    return [strategy.data_shard(mesh, p, process_ids=ids) for p in range(processes)]


@pytest.mark.parametrize(
    ("strategy", "processes", "shards"),
    [
        (DataParallel(), 2, [(0, 2), (1, 2)]),
        (DataParallel(), 4, [(0, 4), (1, 4), (2, 4), (3, 4)]),
        (Hybrid(FSDP(4), TensorParallel(2)), 2, [(0, 2), (1, 2)]),
        (Hybrid(FSDP(4), TensorParallel(2)), 4, [(0, 4), (1, 4), (2, 4), (3, 4)]),
        (Hybrid(DataParallel(2), TensorParallel(4)), 4, [(0, 2), (0, 2), (1, 2), (1, 2)]),
        (TensorParallel(), 2, [(0, 1), (0, 1)]),
        (Hybrid(DataParallel(2), FSDP(2), TensorParallel(2)), 2, [(0, 2), (1, 2)]),
        (Hybrid(DataParallel(2), FSDP(2), TensorParallel(2)), 8, [(i // 2, 4) for i in range(8)]),
    ],
)
def test_data_shard_of_simulated_processes(strategy, processes, shards):
    assert simulated(strategy, processes) == shards
    assert all(isinstance(s, DataShard) for s in simulated(strategy, processes))


def test_data_shard_follows_a_members_batch_sharding():
    # Model axis spanning processes: by default they feed the same rows...
    assert simulated(Hybrid(FSDP(2), TensorParallel(4)), 8) == [(i // 4, 2) for i in range(8)]
    # ...but a member that also splits the batch over it gives each its own rows.
    assert simulated(Hybrid(FSDP(2), BatchOverModel(4)), 8) == [(i, 8) for i in range(8)]


def test_data_shard_refuses_interleaved_processes():
    strategy = DataParallel()
    mesh = strategy.make_mesh()
    message = (
        r"mesh \{'data': 8\}, batch axes \('data',\): process 0 holds batch shards "
        r"\[0, 2, 4, 6\] of 8, not one contiguous.*Order the mesh's devices"
    )
    with pytest.raises(ShardingError, match=message):
        strategy.data_shard(mesh, 0, process_ids=np.arange(8) % 2)


@pytest.mark.parametrize(
    "strategy",
    [
        DataParallel(),
        FSDP(),
        TensorParallel(),
        Hybrid(FSDP(4), TensorParallel(2)),
        Hybrid(DataParallel(2), FSDP(2), TensorParallel(2)),
        Hybrid(FSDP(2), BatchOverModel(4)),
    ],
)
def test_one_real_process_feeds_everything(strategy):
    assert jax.process_count() == 1
    assert strategy.data_shard(strategy.make_mesh()) == DataShard(index=0, count=1)


class FeedEverything(TensorParallel):
    """Overrides question 4: every process feeds the whole batch (records its proposal)."""

    proposed: ClassVar[list[DataShard]] = []

    def data_shard(self, mesh, process_index=None, *, process_ids=None, proposed=None):
        shard = super().data_shard(mesh, process_index, process_ids=process_ids, proposed=proposed)
        type(self).proposed.append(shard)
        return DataShard(index=0, count=1)


class SplitFeatures(DataParallel):
    """Overrides question 2: its axis splits the batch's dimension 1 instead of the rows."""

    def batch_sharding(self, batch, mesh, proposed=None):
        return jax.tree.map(lambda _: NamedSharding(mesh, P(None, self.axis)), batch)


def test_a_members_data_shard_override_takes_effect_inside_hybrid():
    FeedEverything.proposed.clear()
    assert simulated(Hybrid(FSDP(4), TensorParallel(2)), 2) == [(0, 2), (1, 2)]
    assert simulated(Hybrid(FSDP(4), FeedEverything(2)), 2) == [(0, 1), (0, 1)]
    # It was proposed the joint answer, read from the Hybrid's batch sharding.
    assert FeedEverything.proposed == [(0, 2), (1, 2)]
    # Alone too, and the proposal is kept when nothing overrides.
    assert simulated(FeedEverything(8), 2) == [(0, 1), (0, 1)]
    mesh = FSDP().make_mesh()
    assert FSDP().data_shard(mesh, proposed=DataShard(3, 4)) == DataShard(3, 4)
    hybrid = Hybrid(FSDP(4), TensorParallel(2))
    assert hybrid.data_shard(hybrid.make_mesh(), proposed=DataShard(1, 2)) == DataShard(1, 2)


def test_data_shard_reads_the_split_dimension_not_only_the_rows():
    # The batch axes split dimension 1: each process feeds its block of that dimension.
    assert simulated(SplitFeatures(), 2) == [(0, 2), (1, 2)]
    assert simulated(Hybrid(SplitFeatures(4), TensorParallel(2)), 4) == [
        (0, 4),
        (1, 4),
        (2, 4),
        (3, 4),
    ]
    # A model axis spanning the processes still means the same data for both.
    assert simulated(Hybrid(TensorParallel(2), SplitFeatures(4)), 2) == [(0, 1), (0, 1)]


# -- an override that cannot take the answer so far is refused when the Hybrid is built --
class NoProposed(FSDP):
    def state_shardings(self, abstract_state, mesh):  # no proposed=: cannot be chained
        return super().state_shardings(abstract_state, mesh)


class NoJit(TensorParallel):
    def compile_step(self, step_fn, *, in_shardings, out_shardings, donate_argnums=()):
        return jax.jit(step_fn, in_shardings=in_shardings, out_shardings=out_shardings)


class OldDataShard(DataParallel):
    def data_shard(self, mesh, process_index=None, *, process_ids=None):
        return DataShard(0, 1)


class PositionalBatch(DataParallel):
    def batch_sharding(self, batch, mesh, proposed, extra):  # a parameter nobody passes
        return proposed


@pytest.mark.parametrize(
    ("member", "message"),
    [
        (
            NoProposed(4),
            r"Hybrid member NoProposed\(4\) overrides state_shardings\(abstract_state, mesh\)"
            r".*unexpected keyword argument 'proposed'.*Define it as "
            r"state_shardings\(self, abstract_state, mesh, proposed=None\)",
        ),
        (
            NoJit(2),
            r"Hybrid member NoJit\(2\) overrides compile_step.*'jit'.*Define it as "
            r"compile_step\(self, step_fn, \*, in_shardings, out_shardings, "
            r"donate_argnums=\(\), jit=jax.jit\)",
        ),
        (OldDataShard(2), r"OldDataShard\(2\) overrides data_shard.*proposed=None\)"),
        (PositionalBatch(2), r"PositionalBatch\(2\) overrides batch_sharding.*'extra'"),
    ],
    ids=["state_shardings", "compile_step", "data_shard", "batch_sharding"],
)
def test_hybrid_refuses_an_override_that_cannot_take_the_answer_so_far(member, message):
    with pytest.raises(TypeError, match=message):
        Hybrid(member, TensorParallel(2) if not isinstance(member, TensorParallel) else FSDP(4))


def test_a_wrong_override_still_works_alone():
    trainer = build(NoProposed(8, min_size=64))
    assert trainer.model.l1.kernel.get_value().sharding.spec == P(None, "fsdp")


def test_overrides_taking_the_answer_so_far_are_accepted():
    # **kwargs (CountCompiles), proposed= (ReplicateBias, BatchOverModel), proposed= here.
    Hybrid(ReplicateBias(2), BatchOverModel(2), CountCompiles(2, axis="tp"))
    Hybrid(FSDP(4), FeedEverything(2))
