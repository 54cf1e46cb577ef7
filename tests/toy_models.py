"""Small models and data shared by the core tests, plus an independent one-device reference."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from nnx_spmd_trainer import Callback

LECUN = nnx.initializers.lecun_normal()


class Net(nnx.Module):
    """Annotated with physical names (l1), logical names (l2) and not at all (l3, norm)."""

    def __init__(self, rngs: nnx.Rngs, din: int = 16, hidden: int = 32, dout: int = 8) -> None:
        self.l1 = nnx.Linear(
            din,
            hidden,
            kernel_init=nnx.with_partitioning(LECUN, (None, "model")),
            bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("model",)),
            rngs=rngs,
        )
        self.l2 = nnx.Linear(
            hidden,
            hidden,
            kernel_init=nnx.with_metadata(LECUN, out_sharding=("mlp", "embed")),
            rngs=rngs,
        )
        self.norm = nnx.LayerNorm(hidden, rngs=rngs)
        self.l3 = nnx.Linear(hidden, dout, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = nnx.relu(self.l1(x))
        x = nnx.relu(self.norm(self.l2(x)))
        return self.l3(x)


def classification_loss(model: nnx.Module, batch: dict) -> tuple[jax.Array, dict]:
    logits = model(batch["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, {}


def make_batches(n: int, batch_size: int = 16, din: int = 16, classes: int = 8, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.normal(size=(batch_size, din)).astype(np.float32),
            "y": rng.integers(0, classes, size=(batch_size,)).astype(np.int32),
        }
        for _ in range(n)
    ]


def _value_and_grad(graphdef, loss_fn, params, rest, batch):
    """The loss and its gradient (``rest``: the model's state other than its parameters)."""

    def loss(p):
        return loss_fn(nnx.merge(graphdef, p, rest), batch)[0]

    return jax.value_and_grad(loss)(params)


# One jitted function for every call of train_reference: a model structure and loss
# function compiled once (by any test) are not compiled again; a compile costs far more
# than the few steps it runs.
_shared_value_and_grad = jax.jit(_value_and_grad, static_argnums=(0, 1))


def _grad_fn(graphdef, loss_fn):
    try:
        hash((graphdef, loss_fn))
    except TypeError:  # not a jit cache key: compiled for this call alone
        return jax.jit(functools.partial(_value_and_grad, graphdef, loss_fn))
    return functools.partial(_shared_value_and_grad, graphdef, loss_fn)


def train_reference(factory, tx, batches, loss_fn=classification_loss):
    """Plain optax on one device: the independent computation results are checked against."""
    device = jax.devices()[0]
    # A one-device mesh carrying every axis name, so activation constraints still resolve.
    names = ("data", "fsdp", "model", "batch")
    one_device = jax.make_mesh(
        (1,) * 4, names, axis_types=(jax.sharding.AxisType.Auto,) * 4, devices=[device]
    )
    with jax.set_mesh(one_device), jax.default_device(device), nnx.use_eager_sharding(False):
        model = factory(nnx.Rngs(0))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        params = jax.device_put(params, device)
        opt_state = tx.init(params)

        grad_fn = _grad_fn(graphdef, loss_fn)
        losses = []
        for batch in batches:
            value, grads = grad_fn(params, rest, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            losses.append(float(value))
    return params, losses


class RecordLosses(Callback):
    """Reads every step's loss (a host sync per step: fine for a test)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, step: int, logs: dict) -> None:
        self.losses.append(self.trainer.last_step.loss_value())


def flat_params(state: nnx.State) -> dict[str, np.ndarray]:
    return {
        "/".join(map(str, path)): np.asarray(jax.device_get(v.get_value()))
        for path, v in nnx.to_flat_state(state)
    }


def as_numpy(x: jax.Array) -> np.ndarray:
    return np.asarray(jax.device_get(jnp.asarray(x)))


def assert_params_match(trainer, reference_params, rtol: float = 1e-4) -> None:
    """The trainer's parameters equal the one-device reference, within float32 tolerance."""
    got = flat_params(nnx.state(trainer.model, nnx.Param))
    want = flat_params(reference_params)
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=rtol, atol=1e-5, err_msg=key)
