"""Each strategy: promised specs on every leaf, and the same numbers as one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from toy_models import (
    LECUN,
    Net,
    RecordLosses,
    assert_params_match,
    classification_loss,
    make_batches,
    train_reference,
)

from nnx_spmd_trainer import FSDP, DataParallel, Hybrid, ShardingError, TensorParallel, Trainer
from nnx_spmd_trainer.sharding import shard_shape

# What each strategy promises for Net's leaves (fsdp min_size=64 elements):
# l1 annotated (None, "model") / ("model",); l2 logical ("mlp", "embed"); the rest unannotated.
CASES = {
    "dp8": (DataParallel(), {}),
    "fsdp8": (
        FSDP(min_size=64),
        {
            "l1/kernel": P(None, "fsdp"),
            "l2/kernel": P(None, "fsdp"),
            "l3/kernel": P("fsdp"),
        },
    ),
    "tp8": (
        TensorParallel(),
        {
            "l1/kernel": P(None, "model"),
            "l1/bias": P("model"),
            "l2/kernel": P("model"),
        },
    ),
    "dp4xtp2": (
        Hybrid(DataParallel(4), TensorParallel(2)),
        {
            "l1/kernel": P(None, "model"),
            "l1/bias": P("model"),
            "l2/kernel": P("model"),
        },
    ),
    "fsdp4xtp2": (
        Hybrid(FSDP(4, min_size=64), TensorParallel(2)),
        {
            "l1/kernel": P("fsdp", "model"),
            "l1/bias": P("model"),
            "l2/kernel": P("model", "fsdp"),
            "l3/kernel": P("fsdp"),
        },
    ),
    "dp2xfsdp2xtp2": (
        Hybrid(DataParallel(2), FSDP(2, min_size=64), TensorParallel(2)),
        {
            "l1/kernel": P("fsdp", "model"),
            "l1/bias": P("model"),
            "l2/kernel": P("model", "fsdp"),
            "l3/kernel": P("fsdp"),
        },
    ),
}
MESHES = {
    "dp8": {"data": 8},
    "fsdp8": {"fsdp": 8},
    "tp8": {"model": 8},
    "dp4xtp2": {"data": 4, "model": 2},
    "fsdp4xtp2": {"fsdp": 4, "model": 2},
    "dp2xfsdp2xtp2": {"data": 2, "fsdp": 2, "model": 2},
}
STEPS = 4


def build(strategy, **kwargs):
    return Trainer(
        lambda rngs: Net(rngs),
        optax.adam(1e-2),
        strategy=strategy,
        loss_fn=classification_loss,
        **kwargs,
    )


def expected_spec(key: str, promised: dict) -> P:
    for suffix, spec in promised.items():
        if key.endswith(suffix):
            return spec
    return P()


@pytest.mark.parametrize("name", CASES)
def test_every_leaf_has_the_promised_sharding(name):
    strategy, promised = CASES[name]
    trainer = build(strategy)
    assert dict(trainer.mesh.shape) == MESHES[name]
    params = nnx.to_flat_state(nnx.state(trainer.model, nnx.Param))
    opt = nnx.to_flat_state(nnx.state(trainer.optimizer, nnx.optimizer.OptState))
    assert len(params) == 8
    for path, variable in [*params, *opt]:
        key = "/".join(map(str, path))
        array = variable.get_value()
        spec = expected_spec(key, promised) if array.ndim else P()
        assert isinstance(array.sharding, NamedSharding), key
        assert array.sharding.spec == spec, (key, array.sharding.spec, spec)
        per_device = shard_shape(array.shape, spec, MESHES[name])  # the one per-device rule
        assert array.sharding.shard_shape(array.shape) == per_device, key
        assert array.addressable_shards[0].data.shape == per_device, key


@pytest.mark.parametrize("name", ["fsdp8", "fsdp4xtp2", "dp2xfsdp2xtp2"])
def test_fsdp_leaves_nothing_large_replicated(name):
    strategy, _ = CASES[name]
    trainer = build(strategy)
    for path, variable in nnx.to_flat_state(trainer.state):
        array = variable.get_value()
        if array.size >= 64:
            assert "fsdp" in str(array.sharding.spec), (path, array.shape, array.sharding.spec)


@pytest.fixture(scope="module")
def reference():
    """Plain optax on one device over ``make_batches(STEPS)``: the same for every layout."""
    return train_reference(lambda r: Net(r), optax.adam(1e-2), make_batches(STEPS))


@pytest.mark.parametrize("name", CASES)
def test_training_matches_one_device_optax(name, reference):
    strategy, _ = CASES[name]
    batches = make_batches(STEPS)
    recorder = RecordLosses()
    trainer = build(strategy, callbacks=[recorder])
    trainer.fit(batches, max_steps=STEPS)
    ref_params, ref_losses = reference
    np.testing.assert_allclose(recorder.losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert_params_match(trainer, ref_params)
    assert trainer.step == STEPS


class ZeroByHand(DataParallel):
    """A user strategy overriding one hook: shard every matrix's rows over "data"."""

    def state_shardings(self, abstract_state, mesh):
        def one(variable):
            shape = variable.get_value().shape
            spec = P("data") if len(shape) == 2 and shape[0] % mesh.shape["data"] == 0 else P()
            return NamedSharding(mesh, spec)

        return jax.tree.map(one, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def test_custom_strategy_overrides_one_hook(reference):
    batches = make_batches(STEPS)
    trainer = build(ZeroByHand())
    trainer.fit(batches, max_steps=STEPS)
    assert trainer.model.l2.kernel.get_value().sharding.spec == P("data")
    assert trainer.optimizer.opt_state[0].mu["l3"]["kernel"].get_value().sharding.spec == P("data")
    assert trainer.model.l2.bias.get_value().sharding.spec == P()
    assert_params_match(trainer, reference[0])


def test_prebuilt_module_is_placed_with_the_strategy():
    with nnx.use_eager_sharding(False):  # annotated layers built outside any mesh
        model = Net(nnx.Rngs(0))
    trainer = Trainer(
        model,
        optax.adam(1e-2),
        loss_fn=classification_loss,
        strategy=Hybrid(FSDP(4, min_size=64), TensorParallel(2)),
    )
    assert trainer.model.l1.kernel.get_value().sharding.spec == P("fsdp", "model")
    batches = make_batches(2)
    trainer.fit(batches, max_steps=2)
    ref_params, _ = train_reference(lambda r: Net(r), optax.adam(1e-2), batches)
    assert_params_match(trainer, ref_params)


@pytest.mark.parametrize(
    ("strategy", "message"),
    [
        (FSDP(3), r"FSDP\(3\).*'fsdp': 3.*8 available devices"),
        (
            Hybrid(FSDP(4), TensorParallel(4)),
            r"mesh \{'fsdp': 4, 'model': 4\} that does not fit the 8",
        ),
        (Hybrid(FSDP(), TensorParallel()), "only one axis may have size=-1"),
        (Hybrid(DataParallel(2), DataParallel(4)), "uses a mesh axis name twice"),
    ],
)
def test_bad_mesh_is_refused_before_compiling(strategy, message):
    with pytest.raises(ShardingError, match=message):
        build(strategy)


def test_conflicting_rules_in_hybrid():
    with pytest.raises(ShardingError, match="'embed' is mapped to 'fsdp' and to 'model'"):
        build(Hybrid(FSDP(4), TensorParallel(2, rules=(("embed", "model"),))))


def test_renamed_axes_still_honour_the_usual_annotations():
    trainer = build(Hybrid(FSDP(4, axis="shard", min_size=64), TensorParallel(2, axis="tp")))
    assert dict(trainer.mesh.shape) == {"shard": 4, "tp": 2}
    assert trainer.model.l1.kernel.get_value().sharding.spec == P("shard", "tp")
    assert trainer.model.l2.kernel.get_value().sharding.spec == P("tp", "shard")


def test_optimizer_state_shaped_unlike_its_parameter():
    """Adafactor keeps factored moments (one vector per matrix) with the kernel's annotation."""
    batches = make_batches(3)
    tx = optax.adafactor(1e-2, min_dim_size_to_factor=8)
    trainer = Trainer(lambda r: Net(r), tx, strategy=CASES["fsdp4xtp2"][0],
                      loss_fn=classification_loss)  # fmt: skip
    trainer.fit(batches, max_steps=3)
    ref_params, _ = train_reference(lambda r: Net(r), tx, batches)
    assert_params_match(trainer, ref_params)


class WithStats(nnx.Module):
    """Net plus a running statistic annotated with ``annotation``."""

    def __init__(self, rngs: nnx.Rngs, annotation: tuple) -> None:
        self.net = Net(rngs)
        self.running_mean = nnx.BatchStat(jnp.zeros((3,)), out_sharding=annotation)

    def __call__(self, x):
        return self.net(x)


@pytest.mark.parametrize(
    ("annotation", "message"),
    [
        (("model",), r"running_mean with shape \(3,\).*not divisible by mesh axes \('model',\)"),
        (("my_stats",), r"running_mean with shape \(3,\).*unknown axis name 'my_stats'"),
    ],
)
def test_wrongly_annotated_batch_stat_is_refused(annotation, message):
    """Only optimizer state falls back to unannotated; a model's own leaves must fit."""
    with pytest.raises(ShardingError, match=message):
        Trainer(
            lambda rngs: WithStats(rngs, annotation),
            optax.adam(1e-2),
            strategy=TensorParallel(),
            loss_fn=classification_loss,
        )


class ContextNamed(nnx.Module):
    """Annotated with a logical name only a ``nnx.logical_axis_rules`` context maps."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        init = nnx.with_partitioning(LECUN, (None, "my_hidden"))
        self.l1 = nnx.Linear(16, 32, kernel_init=init, rngs=rngs)
        self.l2 = nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


def test_flax_logical_axis_rules_context_is_honoured():
    strategy = Hybrid(DataParallel(4), TensorParallel(2))
    with nnx.logical_axis_rules([("my_hidden", "model"), ("embed", None)]):
        trainer = Trainer(ContextNamed, optax.adam(1e-2), strategy=strategy,
                          loss_fn=classification_loss)  # fmt: skip
    assert trainer.model.l1.kernel.get_value().sharding.spec == P(None, "model")
    mu = trainer.optimizer.opt_state[0].mu["l1"]["kernel"].get_value()
    assert mu.sharding.spec == P(None, "model")
    with pytest.raises(ShardingError, match=r"l1/kernel.*unknown axis name 'my_hidden'"):
        Trainer(ContextNamed, optax.adam(1e-2), strategy=strategy, loss_fn=classification_loss)


class Tagger(nnx.Module):
    """The miniGPT tutorial's pattern: an unannotated ``nnx.Embed`` table (256 x 8) beside
    an annotated kernel, an unannotated norm (a vector) and a small unannotated head."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(256, 8, rngs=rngs)
        self.up = nnx.Linear(
            8, 16, kernel_init=nnx.with_partitioning(LECUN, (None, "model")), rngs=rngs
        )
        self.norm = nnx.LayerNorm(16, rngs=rngs)
        self.head = nnx.Linear(16, 8, rngs=rngs)  # 128 elements: under min_size

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.head(self.norm(nnx.relu(self.up(self.embed(tokens))))).mean(axis=1)


def tag_loss(model, batch):
    logits = model(batch["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), {}


def tag_batches(n: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [
        {"tokens": rng.integers(0, 256, (16, 4)).astype(np.int32), "y": rng.integers(0, 8, 16)}
        for _ in range(n)
    ]


@pytest.mark.parametrize(
    "strategy, table",
    [
        (Hybrid(DataParallel(4), TensorParallel(2)), P(None, "model")),  # its features split
        (Hybrid(FSDP(4, min_size=64), TensorParallel(2)), P("fsdp")),  # FSDP split it first
        (Hybrid(DataParallel(4), TensorParallel(2, min_size=2**63)), P()),  # opted out
    ],
    ids=["dp4xtp2", "fsdp4xtp2", "min_size"],
)
def test_tensor_parallel_splits_a_large_unannotated_matrix_and_trains_the_same(strategy, table):
    """An unannotated table nothing else splits is split over "model" along its features
    (the layout XLA gives the tutorial's under nnx.jit: 1.63x its step time replicated,
    benchmarks/results/minigpt_overhead.md); its Adam moments follow; vectors and small
    leaves stay whole; the numbers are one device's."""
    batches = tag_batches(3)
    trainer = Trainer(Tagger, optax.adam(1e-2), strategy=strategy, loss_fn=tag_loss)
    mu = trainer.optimizer.opt_state[0].mu
    assert trainer.model.embed.embedding.get_value().sharding.spec == table
    assert mu["embed"]["embedding"].get_value().sharding.spec == table
    assert trainer.model.norm.scale.get_value().sharding.spec == P()
    assert trainer.model.head.kernel.get_value().sharding.spec in (P(), P("fsdp"))
    assert trainer.model.up.kernel.get_value().sharding.spec[-1] == "model"
    trainer.fit(batches, max_steps=3)
    assert trainer.model.embed.embedding.get_value().sharding.spec == table  # kept by steps
    ref_params, _ = train_reference(Tagger, optax.adam(1e-2), batches, loss_fn=tag_loss)
    assert_params_match(trainer, ref_params, rtol=1e-5)


def test_tensor_parallel_leaves_an_unannotated_leaf_to_explicit_types():
    """Under explicit axes the model's types are the layout: nothing unannotated is split
    (a split the model's code did not declare could make its gathers ambiguous)."""
    strategy = Hybrid(DataParallel(4), TensorParallel(2), axis_types="explicit")
    trainer = Trainer(Tagger, optax.adam(1e-2), strategy=strategy, loss_fn=tag_loss)
    assert trainer.model.embed.embedding.get_value().sharding.spec == P()
    assert trainer.model.up.kernel.get_value().sharding.spec == P(None, "model")
