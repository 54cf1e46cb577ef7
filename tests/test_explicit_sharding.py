"""Models written for JAX's explicit sharding mode train under every strategy (axis_types).

An explicit-mode model reads and states shardings as part of its arrays' types
(``jax.typeof(x).sharding``, ``out_sharding=``, ``jax.sharding.reshard``); with
``axis_types="explicit"`` a strategy builds its mesh of Explicit axes and the
model trains to the numbers of the same model trained with plain optax on one
device. On an Auto mesh (the default) the same model fails with an error that
names the switch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from toy_models import RecordLosses, flat_params

from nnx_spmd_trainer import (
    FSDP,
    DataParallel,
    Hybrid,
    Plan,
    SequenceParallel,
    TensorParallel,
    Trainer,
)
from nnx_spmd_trainer.attention import causal_attention
from nnx_spmd_trainer.strategies.axis_types import ExplicitModeError

STEPS = 3


class TypedMLP(nnx.Module):
    """Explicit-mode code that runs under any mesh: the output's sharding is read from
    the input's type, and the contraction over the hidden (``model``) dimension, which
    is ambiguous in explicit mode, states it with ``out_sharding=``."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(
            8, 32, kernel_init=nnx.with_partitioning(init, (None, "model")), rngs=rngs
        )
        self.down = nnx.Linear(
            32, 4, kernel_init=nnx.with_partitioning(init, ("model", None)), rngs=rngs
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        rows = jax.typeof(x).sharding  # the batch's layout, whichever strategy laid it out
        return self.down(nnx.relu(self.up(x)), out_sharding=rows)


def squared_error(model: nnx.Module, batch: dict) -> tuple[jax.Array, dict]:
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2), {}


def sequence_batches(n: int = STEPS) -> list[dict[str, np.ndarray]]:
    """(rows, sequence, features) batches: a sequence dimension for SequenceParallel."""
    rng = np.random.default_rng(0)
    return [
        {
            "x": rng.normal(size=(16, 8, 8)).astype(np.float32),
            "y": rng.normal(size=(16, 8, 4)).astype(np.float32),
        }
        for _ in range(n)
    ]


def train_one_device(factory, batches, *, mesh=None):
    """Plain optax on one device: no mesh unless ``mesh`` (a one-device mesh) is given."""
    context = jax.set_mesh(mesh) if mesh is not None else jax.default_device(jax.devices()[0])
    with context, nnx.use_eager_sharding(False):
        model = factory(nnx.Rngs(0))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        tx = optax.adam(1e-2)
        opt_state = tx.init(params)

        @jax.jit
        def step(params, opt_state, batch):
            def loss(p):
                return squared_error(nnx.merge(graphdef, p, rest), batch)[0]

            value, grads = jax.value_and_grad(loss)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value

        losses = []
        for batch in batches:
            params, opt_state, value = step(params, opt_state, batch)
            losses.append(float(value))
    return flat_params(params), losses


def train(factory, strategy, batches):
    record = RecordLosses()
    trainer = Trainer(
        factory, optax.adam(1e-2), strategy=strategy, loss_fn=squared_error, callbacks=[record]
    )
    trainer.fit(batches, max_steps=len(batches))
    return trainer, record.losses


def assert_same_training(trainer, losses, reference) -> None:
    want_params, want_losses = reference
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    got = flat_params(nnx.state(trainer.model, nnx.Param))
    assert got.keys() == want_params.keys()
    for key, want in want_params.items():
        np.testing.assert_allclose(got[key], want, rtol=1e-4, atol=1e-6, err_msg=key)


@pytest.fixture(scope="module")
def typed_mlp_reference():
    batches = sequence_batches()
    return batches, train_one_device(TypedMLP, batches)


EXPLICIT = {"axis_types": "explicit"}


@pytest.mark.parametrize(
    "strategy",
    [
        DataParallel(**EXPLICIT),
        FSDP(**EXPLICIT),
        Hybrid(FSDP(4), TensorParallel(2), **EXPLICIT),
        SequenceParallel(8, **EXPLICIT),
    ],
    ids=repr,
)
def test_a_typed_model_trains_like_one_device_under_every_strategy(strategy, typed_mlp_reference):
    batches, reference = typed_mlp_reference
    trainer, losses = train(TypedMLP, strategy, batches)
    mesh = trainer.plan.mesh
    assert set(mesh.axis_types) == {AxisType.Explicit}
    assert_same_training(trainer, losses, reference)
    # The parameters live on the explicit mesh, laid out as the strategy said.
    kernel = trainer.model.up.kernel.get_value()
    assert kernel.sharding.mesh == mesh
    want = P(None, "model") if "model" in mesh.shape else P()
    assert kernel.sharding.spec == want


class Reproduction(nnx.Module):
    """The issue's model: an explicit reshard of its output onto the fsdp axis."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.l = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.sharding.reshard(self.l(x), jax.P("fsdp"))


def reproduction_loss(model: nnx.Module, batch: dict) -> tuple[jax.Array, dict]:
    return (model(batch["x"]) ** 2).mean(), {}


REPRODUCTION_BATCHES = [{"x": np.ones((8, 8), np.float32)}]


def test_the_reproduction_trains_with_an_explicit_mesh():
    trainer = Trainer(
        lambda r: Reproduction(r),
        optax.adam(1e-3),
        strategy=FSDP(8, axis_types="explicit"),
        loss_fn=reproduction_loss,
    )
    history = trainer.fit(REPRODUCTION_BATCHES, max_steps=1)
    # The same model without its (layout-only) reshard, on one device: the same loss.
    linear = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
    want = float((linear(jnp.ones((8, 8))) ** 2).mean())
    np.testing.assert_allclose(history.history["train/loss"][-1], want, rtol=1e-5)


def test_on_an_auto_mesh_the_error_names_the_switch():
    trainer = Trainer(
        lambda r: Reproduction(r), optax.adam(1e-3), strategy=FSDP(8), loss_fn=reproduction_loss
    )
    with pytest.raises(ExplicitModeError, match='axis_types="explicit"') as caught:
        trainer.fit(REPRODUCTION_BATCHES, max_steps=1)
    assert "of type Auto" in str(caught.value.__cause__)  # JAX's own error, chained


# -- Flax's "Scale up on multiple devices" guide, explicit section, as written there --------
# Shardings passed to the initializers (out_sharding=), an out_sharding= on the ambiguous
# jnp.dot, the mesh axes named as the guide names them.
class ExplicitDotReluDot(nnx.Module):
    def __init__(self, depth: int, rngs: nnx.Rngs):
        init_fn = nnx.initializers.lecun_normal()
        self.dot1 = nnx.Linear(
            depth,
            depth,
            kernel_init=functools.partial(init_fn, out_sharding=P(None, "model")),
            use_bias=False,
            rngs=rngs,
        )
        self.w2 = nnx.Param(
            init_fn(rngs.params(), (depth, depth), out_sharding=P("model", None)),
        )
        self.b2 = nnx.Param(jnp.zeros((depth,), out_sharding=P(None)))

    def __call__(self, x: jax.Array):
        y = self.dot1(x)
        y = jax.nn.relu(y)
        z = jnp.dot(y, self.w2[...], out_sharding=P("data", None))
        z = z + self.b2
        return z


def guide_loss(model: nnx.Module, batch: dict) -> tuple[jax.Array, dict]:
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2), {}


def test_the_flax_guides_explicit_model_trains_like_one_device():
    rng = np.random.default_rng(0)
    batches = [
        {
            "x": rng.normal(size=(8, 16)).astype(np.float32),
            "y": rng.normal(size=(8, 16)).astype(np.float32),
        }
        for _ in range(STEPS)
    ]
    factory = functools.partial(ExplicitDotReluDot, 16)
    strategy = Hybrid(DataParallel(2), TensorParallel(4), axis_types="explicit")
    record = RecordLosses()
    trainer = Trainer(
        lambda rngs: factory(rngs=rngs),
        optax.adam(1e-2),
        strategy=strategy,
        loss_fn=guide_loss,
        callbacks=[record],
    )
    # The layout the model declared in its initializers is the one the state is born with.
    mesh = trainer.plan.mesh
    kernel, w2 = trainer.model.dot1.kernel.get_value(), trainer.model.w2.get_value()
    assert kernel.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "model")), 2)
    assert w2.sharding.is_equivalent_to(NamedSharding(mesh, P("model", None)), 2)
    trainer.fit(batches, max_steps=STEPS)
    # One device: the model names its mesh axes, so it needs a mesh of them, of one device.
    one_device = jax.make_mesh(
        (1, 1), ("data", "model"), axis_types=(AxisType.Explicit,) * 2, devices=jax.devices()[:1]
    )
    reference = train_one_device(lambda rngs: factory(rngs=rngs), batches, mesh=one_device)
    assert_same_training(trainer, record.losses, reference)


# -- the option itself ---------------------------------------------------------------------
def test_hybrid_members_must_agree_unless_the_hybrid_decides():
    with pytest.raises(ValueError, match="disagree"):
        Hybrid(FSDP(4, axis_types="explicit"), TensorParallel(2))
    decided = Hybrid(FSDP(4), TensorParallel(2), axis_types="explicit")
    assert [m.axis_types for m in decided.members] == ["explicit", "explicit"]
    agreed = Hybrid(FSDP(4, axis_types="explicit"), TensorParallel(2, axis_types="explicit"))
    assert agreed.axis_types == "explicit"
    assert Hybrid(FSDP(4), TensorParallel(2)).axis_types == "auto"


def test_an_unknown_mode_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="'auto', 'explicit'"):
        FSDP(axis_types="Explicit")  # type: ignore[arg-type]


def test_explicit_fsdp_shards_only_what_the_model_declares():
    plan_auto = Plan(TypedMLP, optax.sgd(0.1), strategy=FSDP(min_size=1))
    plan_explicit = Plan(TypedMLP, optax.sgd(0.1), strategy=FSDP(min_size=1, axis_types="explicit"))
    auto_spec = plan_auto.shardings["model"]["up"]["kernel"].spec
    explicit_spec = plan_explicit.shardings["model"]["up"]["kernel"].spec
    assert "fsdp" in str(auto_spec) and explicit_spec == P()


def test_a_model_stating_shardings_as_it_builds_names_the_switch_on_an_auto_mesh():
    with pytest.raises(ExplicitModeError, match='axis_types="explicit"'):
        Plan(
            lambda rngs: ExplicitDotReluDot(16, rngs),
            optax.adam(1e-2),
            strategy=Hybrid(DataParallel(2), TensorParallel(4)),
        )


def test_causal_attention_splits_the_sequence_on_an_explicit_mesh_too():
    # On an Explicit mesh a sharding constraint only asserts; the gather is a reshard.
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(2, 16, 2, 4)).astype(np.float32) for _ in range(3))
    want = causal_attention(q, k, v)
    mesh = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(AxisType.Explicit,) * 2)
    split = NamedSharding(mesh, P("data", "seq"))
    with jax.set_mesh(mesh), nnx.logical_axis_rules([("length", "seq")]):
        got = jax.jit(causal_attention)(*(jax.device_put(a, split) for a in (q, k, v)))
    assert got.sharding.is_equivalent_to(split, 4)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
