"""Sharded initialisation: state born with its final layout, never whole on one device."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import Mesh

from nnx_spmd_trainer.strategies import Strategy

ModelFactory = Callable[[nnx.Rngs], nnx.Module]


class ShardedInit:
    """Builds ``{"model": ..., "optimizer": ...}`` in one ``jax.jit`` with the strategy's layout.

    ``nnx.eval_shape`` gives the abstract state, the strategy answers one
    sharding per leaf, and the jitted builder returns every leaf (optimizer
    moments included) already laid out: the seeds' "sharded initialization".

    Attributes:
      graphdef: static structure of ``{"model": model, "optimizer": optimizer}``.
      abstract_state: shapes, dtypes and sharding metadata, no arrays.
      shardings: a NamedSharding per state leaf.
      init_fn: the jitted builder (``init_fn.lower(*args).compile()`` for memory analysis).
    """

    def __init__(
        self,
        build: Callable[..., dict[str, Any]],
        strategy: Strategy,
        mesh: Mesh,
        *args: Any,
    ) -> None:
        def build_state(*a: Any) -> nnx.State:
            with nnx.use_eager_sharding(False):  # layout comes from out_shardings below
                return nnx.state(build(*a))

        with nnx.use_eager_sharding(False):
            self.graphdef, self.abstract_state = nnx.split(nnx.eval_shape(build, *args))
        self.shardings = strategy.state_shardings(self.abstract_state, mesh)
        # A pre-built module's placed arrays are donated: its state is never held twice.
        donate = tuple(range(len(args)))
        self.init_fn = jax.jit(build_state, out_shardings=self.shardings, donate_argnums=donate)
        self.mesh = mesh
        self.args = args

    def __call__(self) -> nnx.State:
        args, self.args = self.args, ()  # donated below: drop our reference
        with jax.set_mesh(self.mesh):
            return self.init_fn(*args)


def model_builder(
    model: ModelFactory | nnx.Module,
    tx: optax.GradientTransformation,
    strategy: Strategy,
    mesh: Mesh,
    seed: int,
) -> ShardedInit:
    """A ShardedInit for a model factory, or for an already-built module."""

    def with_optimizer(module: nnx.Module) -> dict[str, Any]:
        if not isinstance(module, nnx.Module):
            raise TypeError(
                f"The model factory returned {type(module).__name__}, not an nnx.Module. "
                "Pass model=lambda rngs: MyModel(..., rngs=rngs)."
            )
        return {"model": module, "optimizer": nnx.Optimizer(module, tx, wrt=nnx.Param)}

    if isinstance(model, nnx.Module):
        graphdef, model_state = nnx.split(model)
        model_state = jax.device_put(model_state, strategy.state_shardings(model_state, mesh))
        return ShardedInit(
            lambda s: with_optimizer(nnx.merge(graphdef, s)), strategy, mesh, model_state
        )
    if not callable(model):
        raise TypeError(f"model must be an nnx.Module or a factory rngs -> Module, got {model!r}.")
    return ShardedInit(lambda: with_optimizer(model(nnx.Rngs(seed))), strategy, mesh)
