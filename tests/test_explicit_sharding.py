"""Models written for JAX's explicit sharding mode train under every strategy (axis_types).

An explicit-mode model reads and states shardings as part of its arrays' types
(``jax.typeof(x).sharding``, ``out_sharding=``, ``jax.sharding.reshard``); with
``axis_types="explicit"`` a strategy builds its mesh of Explicit axes and the
model trains to the numbers of the same model trained with plain optax on one
device. On an Auto mesh (the default) the same model fails with an error that
names the switch.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

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
    ExplicitModeError,
    Hybrid,
    Plan,
    SequenceParallel,
    TensorParallel,
    Trainer,
)
from nnx_spmd_trainer.nn.attention import causal_attention
from nnx_spmd_trainer.strategies import axis_types

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
    assert ExplicitModeError is axis_types.ExplicitModeError  # exported at the top level
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


class ExplicitMultiDotReluDot(nnx.Module):
    """The guide's trained model: a stack of ``ExplicitDotReluDot`` made by ``jax.vmap``
    (``spmd_axis_name=None``: the layer axis replicated), run by ``jax.lax.scan``."""

    def __init__(self, depth: int, num_layers: int, rngs: nnx.Rngs):
        @functools.partial(jax.vmap, spmd_axis_name=None)
        def create_sublayers(r):
            return ExplicitDotReluDot(depth, r)

        self.layers = create_sublayers(rngs.fork(split=num_layers))

    def __call__(self, x):
        def scan_over_layers(x, layer):
            return layer(x), None

        x, _ = jax.lax.scan(scan_over_layers, x, self.layers)
        return x


def the_guides_training_loop(factory, batches, mesh) -> tuple[dict, list[float]]:
    """The guide's own loop: ``jax.jit`` over model and ``nnx.Optimizer``, the data put on
    ``P('data', None)``, all under ``jax.set_mesh`` of its mesh.

    One change: the step returns the optimizer too. As the guide writes it (``return
    model, loss``) the optimizer's updated state is dropped at the ``jax.jit`` boundary
    under Flax 0.12.8 (its step count stays 0, so every update is Adam's first): its third
    loss then differs from one device's by 7e-3.
    """

    @jax.jit
    def train_step(model, optimizer, x, y):
        def loss_fn(model):
            y_pred = model(x)
            return jnp.mean((y_pred - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return model, optimizer, loss

    losses = []
    with jax.set_mesh(mesh):
        model = factory(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        for batch in batches:
            x, y = (jax.device_put(batch[k], P("data", None)) for k in ("x", "y"))
            model, optimizer, loss = train_step(model, optimizer, x, y)
            losses.append(float(loss))
    return flat_params(nnx.state(model, nnx.Param)), losses


# rngs.fork(split=) is the guide's spelling; Flax 0.12 warns it is deprecated.
@pytest.mark.filterwarnings("ignore:The 'split' argument of 'fork' is deprecated")
def test_the_flax_guides_explicit_model_trains_like_one_device():
    rng = np.random.default_rng(0)
    batches = [
        {
            "x": rng.normal(size=(8, 16)).astype(np.float32),
            "y": rng.normal(size=(8, 16)).astype(np.float32),
        }
        for _ in range(STEPS)
    ]

    def factory(rngs: nnx.Rngs) -> ExplicitMultiDotReluDot:
        return ExplicitMultiDotReluDot(16, 2, rngs=rngs)

    # The guide's mesh: ('data', 'model') of (2, 4), both axes Explicit.
    strategy = Hybrid(DataParallel(2), TensorParallel(4), axis_types="explicit")
    record = RecordLosses()
    trainer = Trainer(
        factory, optax.adam(1e-2), strategy=strategy, loss_fn=guide_loss, callbacks=[record]
    )
    # The layout the model declared in its initializers is the one the state is born with,
    # the vmapped layer axis replicated.
    mesh = trainer.plan.mesh
    kernel, w2 = trainer.model.layers.dot1.kernel.get_value(), trainer.model.layers.w2.get_value()
    assert kernel.sharding.is_equivalent_to(NamedSharding(mesh, P(None, None, "model")), 3)
    assert w2.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "model", None)), 3)
    trainer.fit(batches, max_steps=STEPS)
    # The guide's own jit loop on its own explicit mesh...
    explicit_mesh = jax.make_mesh(
        (2, 4), ("data", "model"), axis_types=(AxisType.Explicit, AxisType.Explicit)
    )
    assert_same_training(
        trainer, record.losses, the_guides_training_loop(factory, batches, explicit_mesh)
    )
    # ...and one device: the model names its mesh axes, so a mesh of them, of one device.
    one_device = jax.make_mesh(
        (1, 1), ("data", "model"), axis_types=(AxisType.Explicit,) * 2, devices=jax.devices()[:1]
    )
    assert_same_training(
        trainer, record.losses, train_one_device(factory, batches, mesh=one_device)
    )


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


# -- The JAX training cookbook's style, as written there ------------------------------------
# https://docs.jax.dev/en/latest/the-training-cookbook.html (companion script
# docs/the-training-cookbook.py in jax-ml/jax): a static Config carrying every layout as a
# jax.P, parameters born sharded from jax.nn.initializers (their sharding argument),
# activations typed with out_sharding= on every einsum and on the embedding gather, a
# jax.make_mesh of Explicit axes under jax.set_mesh, batches placed with
# jax.make_array_from_process_local_data, and a hand-written jit train step with Adam over
# jax.Ref state. The sizes are tiny and float32 (the cookbook's are 512-wide in bfloat16).
@jax.tree_util.register_static
@dataclasses.dataclass(kw_only=True, frozen=True)
class CookbookConfig:
    mesh_axis_names: tuple[str, ...] = ("fsdp",)
    mesh_shape: tuple[int, ...] = (8,)
    seq_length: int = 16
    host_batch_size: int = 16
    learning_rate: float = 1e-2
    beta_1: float = 0.9
    beta_2: float = 0.999
    eps: float = 1e-8
    param_seed: int = 12738
    num_layers: int = 1
    embed_dim: int = 16
    mlp_dim: int = 32
    vocab_size: int = 32
    num_heads: int = 8
    head_dim: int = 4
    dtype: str = "float32"

    embed: P = P(None, None)
    pos_embed: P = P(None, None)
    att_qkv: P = P(None, "fsdp", None, None)
    att_out: P = P("fsdp", None, None)
    mlp_in: P = P("fsdp", None)
    mlp_out: P = P(None, "fsdp")
    out_kernel: P = P("fsdp", None)

    act_seq: P = P("fsdp", None, None)
    act_att: P = P("fsdp", None, None, None)
    act_hidden: P = P("fsdp", None, None)


def cookbook_init_params(config: CookbookConfig) -> dict:
    """The cookbook's parameter state: every initializer given its layout."""
    root_key = jax.random.key(config.param_seed)
    key = map(functools.partial(jax.random.fold_in, root_key), itertools.count())
    zero_init = jax.nn.initializers.constant(0.0)
    he_init = jax.nn.initializers.he_normal(1, 1)
    c, dtype = config, config.dtype
    params: dict = {
        "pos_embed": zero_init(next(key), (c.seq_length, c.embed_dim), dtype, c.pos_embed),
        "embedding": he_init(next(key), (c.vocab_size, c.embed_dim), dtype, c.embed),
        "linear_out": {
            "kernel": he_init(next(key), (c.embed_dim, c.vocab_size), dtype, c.out_kernel)
        },
        "layers": [],
    }
    for _ in range(c.num_layers):
        qkv_shape = (3, c.embed_dim, c.num_heads, c.head_dim)
        out_shape = (c.num_heads, c.head_dim, c.embed_dim)
        params["layers"].append(
            {
                "attention": {
                    "qkv": he_init(next(key), qkv_shape, dtype, c.att_qkv),
                    "out": he_init(next(key), out_shape, dtype, c.att_out),
                },
                "mlp": {
                    "in_kernel": he_init(next(key), (c.embed_dim, c.mlp_dim), dtype, c.mlp_in),
                    "out_kernel": he_init(next(key), (c.mlp_dim, c.embed_dim), dtype, c.mlp_out),
                },
            }
        )
    return params


def cookbook_model_apply(config: CookbookConfig, params: dict, tokens: jax.Array) -> jax.Array:
    """The cookbook's decoder: each activation's layout stated where it is made."""
    out = params["embedding"].at[tokens].get(out_sharding=config.act_seq)
    out += params["pos_embed"]
    for block in params["layers"]:
        att, mlp = block["attention"], block["mlp"]
        att_skip = out
        qkv = jnp.einsum("bsd,3dkh->bs3kh", out, att["qkv"], out_sharding=config.act_att)
        out = jax.nn.dot_product_attention(
            qkv[:, :, 0, :], qkv[:, :, 1, :], qkv[:, :, 2, :], is_causal=True
        )
        out = jnp.einsum("bskh,khd->bsd", out, att["out"], out_sharding=config.act_seq)
        out += att_skip
        out *= jax.lax.rsqrt(jnp.mean(out**2, axis=-1, keepdims=True) + 1e-6)

        mlp_skip = out
        out = jnp.einsum("bsd,dh->bsh", out, mlp["in_kernel"], out_sharding=config.act_hidden)
        out = jax.nn.gelu(out)
        out = jnp.einsum("bsh,hd->bsd", out, mlp["out_kernel"], out_sharding=config.act_seq)
        out += mlp_skip
        out *= jax.lax.rsqrt(jnp.mean(out**2, axis=-1, keepdims=True) + 1e-6)
    return jnp.einsum(
        "bsd,dl->bsl", out, params["linear_out"]["kernel"], out_sharding=config.act_seq
    )


def cookbook_cross_entropy(config: CookbookConfig, logits: jax.Array, targets: jax.Array):
    labels = jax.nn.one_hot(targets, config.vocab_size)
    return -(labels * jax.nn.log_softmax(logits)).sum(axis=-1).mean()


def cookbook_loss(config: CookbookConfig, params: dict, batch: dict) -> jax.Array:
    """The cookbook's loss, over its parameter tree."""
    logits = cookbook_model_apply(config, params, batch["observed_ids"])
    return cookbook_cross_entropy(config, logits, batch["target_ids"])


def cookbook_train_loop(config: CookbookConfig, batches: list[dict]) -> tuple[dict, list[float]]:
    """The cookbook's own loop: jit init, Adam by hand on jax.Ref state, batches placed on
    the explicit mesh with make_array_from_process_local_data."""

    def adam_update(param: jax.Ref, grad: jax.Array, adam_state: dict) -> None:
        c = config
        adam_state["mu"][...] = c.beta_1 * adam_state["mu"][...] + (1 - c.beta_1) * grad
        adam_state["nu"][...] = c.beta_2 * adam_state["nu"][...] + (1 - c.beta_2) * grad**2
        adam_state["count"][...] += 1
        mu_hat = adam_state["mu"][...] / (1 - c.beta_1 ** adam_state["count"][...])
        nu_hat = adam_state["nu"][...] / (1 - c.beta_2 ** adam_state["count"][...])
        param[...] -= c.learning_rate * mu_hat / (jnp.sqrt(nu_hat) + c.eps)

    @jax.jit
    def init_train_state() -> dict:
        params = cookbook_init_params(config)
        adam = {"mu": jnp.zeros_like, "nu": jnp.zeros_like, "count": lambda p: jnp.array(0)}
        return {
            "params": params,
            "opt": jax.tree.map(lambda p: {k: f(p) for k, f in adam.items()}, params),
        }

    @jax.jit
    def train_step(train_state: dict, batch: dict) -> jax.Array:
        params = jax.tree.map(jax.ref.get, train_state["params"])
        loss, grad = jax.value_and_grad(functools.partial(cookbook_loss, config))(params, batch)
        is_adam = lambda x: isinstance(x, dict) and "mu" in x  # noqa: E731
        jax.tree.map(adam_update, train_state["params"], grad, train_state["opt"], is_leaf=is_adam)
        return loss

    mesh = jax.make_mesh(
        config.mesh_shape,
        config.mesh_axis_names,
        len(config.mesh_shape) * (AxisType.Explicit,),
    )
    with jax.set_mesh(mesh):
        train_state = jax.tree.map(jax.ref.new_ref, init_train_state())
        place = functools.partial(jax.make_array_from_process_local_data, P(config.mesh_axis_names))
        losses = [float(train_step(train_state, jax.tree.map(place, b))) for b in batches]
        params = jax.tree.map(lambda ref: np.asarray(ref[...]), train_state["params"])
    return params, losses


class CookbookDecoder(nnx.Module):
    """The cookbook's model as an NNX module, unchanged: its parameter tree held as
    ``nnx.Param`` leaves, its apply function called on their values."""

    def __init__(self, config: CookbookConfig) -> None:
        self.config = config
        self.params = nnx.data(jax.tree.map(nnx.Param, cookbook_init_params(config)))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        values = jax.tree.map(lambda v: v[...], self.params, is_leaf=_is_variable)
        return cookbook_model_apply(self.config, values, tokens)


def _is_variable(x: object) -> bool:
    return isinstance(x, nnx.Variable)


def cookbook_batches(config: CookbookConfig, n: int = STEPS) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    shape = (config.host_batch_size, config.seq_length + 1)
    tokens = [rng.integers(0, config.vocab_size, shape).astype(np.int32) for _ in range(n)]
    return [
        {
            "observed_ids": np.ascontiguousarray(t[:, :-1]),
            "target_ids": np.ascontiguousarray(t[:, 1:]),
        }
        for t in tokens
    ]


def test_the_jax_training_cookbooks_model_trains_like_its_own_loop():
    config = CookbookConfig()
    batches = cookbook_batches(config)
    record = RecordLosses()
    trainer = Trainer(
        lambda rngs: CookbookDecoder(config),  # the cookbook seeds from its config
        optax.adam(config.learning_rate, config.beta_1, config.beta_2, config.eps),
        strategy=FSDP(8, axis_types="explicit"),  # its mesh: ("fsdp",) of 8, Explicit
        loss_fn=lambda model, batch: (
            cookbook_cross_entropy(config, model(batch["observed_ids"]), batch["target_ids"]),
            {},
        ),
        callbacks=[record],
    )
    # Every parameter is born with the layout its initializer was given, nothing more.
    layer = trainer.model.params["layers"][0]
    mesh = trainer.plan.mesh
    for variable, spec in [
        (layer["attention"]["qkv"], config.att_qkv),
        (layer["mlp"]["out_kernel"], config.mlp_out),
        (trainer.model.params["embedding"], config.embed),
    ]:
        assert variable.get_value().sharding.is_equivalent_to(NamedSharding(mesh, spec), len(spec))
    trainer.fit(batches, max_steps=len(batches))

    want_params, want_losses = cookbook_train_loop(config, batches)
    np.testing.assert_allclose(record.losses, want_losses, rtol=1e-5)
    got = jax.tree.map(
        lambda v: np.asarray(v.get_value()), trainer.model.params, is_leaf=_is_variable
    )
    flat_got, flat_want = (dict(jax.tree_util.tree_leaves_with_path(t)) for t in (got, want_params))
    assert flat_got.keys() == flat_want.keys()
    for path, want in flat_want.items():
        np.testing.assert_allclose(flat_got[path], want, rtol=1e-4, atol=1e-6, err_msg=str(path))
