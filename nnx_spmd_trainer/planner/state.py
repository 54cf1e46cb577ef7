"""Training state: born sharded (never whole on one device), then held by the live objects."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from nnx_spmd_trainer import sharding as sh
from nnx_spmd_trainer.strategies.axis_types import building_under
from nnx_spmd_trainer.strategies.base import is_variable

ModelFactory = Callable[[nnx.Rngs], nnx.Module]


#: The layout of a state: ``abstract state -> a NamedSharding per leaf`` (the plan's
#: ``state_shardings``, which asks its strategy).
StateShardings = Callable[[nnx.State], Any]


class ShardedInit:
    """Builds ``{"model": ..., "optimizer": ...}`` in one ``jax.jit`` with the plan's layout.

    ``nnx.eval_shape`` gives the abstract state, ``state_shardings`` answers one
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
        state_shardings: StateShardings,
        mesh: Mesh,
        *args: Any,
    ) -> None:
        def build_state(*a: Any, params: nnx.State | None = None) -> nnx.State:
            with nnx.use_eager_sharding(False):  # layout comes from out_shardings below
                return nnx.state(build(*a, params=params))

        with building_under(mesh), nnx.use_eager_sharding(False):  # explicit: its mesh set
            abstract = nnx.eval_shape(lambda *a: build(*a, params=None), *args)
            self.graphdef, self.abstract_state = nnx.split(abstract)
        self.shardings = state_shardings(self.abstract_state)
        # A pre-built module's placed arrays are donated: its state is never held twice.
        donate = tuple(range(len(args)))
        self.init_fn = jax.jit(
            build_state,
            out_shardings=self.shardings,
            donate_argnums=donate,
            donate_argnames="params",
        )
        self.mesh = mesh
        self.args: tuple[Any, ...] | None = args

    def __call__(self, params: nnx.State | None = None) -> nnx.State:
        """The initial state; with ``params`` (donated), the model's parameters are those
        and the optimizer's state is made from them. Traced in the same jit, the random
        parameters they replace are dead code: they are never built."""
        if self.args is None:
            raise RuntimeError(
                "This plan's state was built from a built module, whose arrays it took: it "
                "builds once. Give each Trainer its own Plan, or give the plan a factory "
                "(model=lambda rngs: MyModel(..., rngs=rngs))."
            )
        args = self.args
        self.args = None if args else ()  # donated below: drop our reference
        with jax.set_mesh(self.mesh):
            return self.init_fn(*args) if params is None else self.init_fn(*args, params=params)


def model_builder(
    model: ModelFactory | nnx.Module,
    tx: optax.GradientTransformation,
    state_shardings: StateShardings,
    mesh: Mesh,
    seed: int,
    wrt: nnx.filterlib.Filter = nnx.Param,
    *,
    transform: Callable[[nnx.Module], nnx.Module] | None = None,
) -> ShardedInit:
    """A ShardedInit for a model factory, or for an already-built module.

    ``wrt`` filters what the optimizer trains (``nnx.Optimizer(..., wrt=wrt)``).
    ``transform`` changes the built module inside the jitted builder, before pretrained
    parameters replace its own (a plan's LoRA adapters: ``nn.lora.initializer``).
    """
    if not isinstance(tx, optax.GradientTransformation):
        hint = " (call it: optax.adam(1e-3))" if callable(tx) else ""
        raise TypeError(f"optimizer must be an optax GradientTransformation, got {tx!r}{hint}.")

    def with_optimizer(module: nnx.Module, params: nnx.State | None) -> dict[str, Any]:
        if not isinstance(module, nnx.Module):
            raise TypeError(
                f"The model factory returned {type(module).__name__}, not an nnx.Module. "
                "Pass model=lambda rngs: MyModel(..., rngs=rngs)."
            )
        if transform is not None:
            module = transform(module)
        if params is not None:  # pretrained parameters, before the optimizer reads them
            nnx.update(module, params)
        # Extra-args support: the step passes value=loss, which plateau schedules and line
        # searches read and every other transformation ignores.
        optimizer = nnx.Optimizer(module, optax.with_extra_args_support(tx), wrt=wrt)
        return {"model": module, "optimizer": optimizer}

    if isinstance(model, nnx.Module):
        graphdef, model_state = nnx.split(model)
        model_state = jax.device_put(model_state, state_shardings(model_state))
        return ShardedInit(
            lambda s, params: with_optimizer(nnx.merge(graphdef, s), params),
            state_shardings,
            mesh,
            model_state,
        )
    if not callable(model):
        raise TypeError(f"model must be an nnx.Module or a factory rngs -> Module, got {model!r}.")
    _check_takes_rngs(model)
    return ShardedInit(
        lambda params: with_optimizer(model(nnx.Rngs(seed)), params), state_shardings, mesh
    )


def _check_takes_rngs(factory: Callable[..., Any]) -> None:
    """A factory that cannot take the one ``nnx.Rngs`` it is called with fails here, in
    one line, and not under ``nnx.eval_shape`` deep in the plan."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        return
    try:
        signature.bind(nnx.Rngs(0))
    except TypeError as error:
        raise TypeError(
            f"model={getattr(factory, '__qualname__', factory)!r} is called with one "
            f"argument, an nnx.Rngs, and cannot take it ({error}). Pass "
            "model=lambda rngs: MyModel(..., rngs=rngs), or a built module "
            "model=MyModel(..., rngs=nnx.Rngs(0))."
        ) from None


class LiveState:
    """The live ``{"model": ..., "optimizer": ...}`` objects: the one authority for the state.

    The compiled step takes and returns the flat list of their arrays
    (``arrays()``); ``write`` puts a step's results back into the same
    ``nnx.Variable`` objects, so ``trainer.model`` is current after every step
    and nothing is synced lazily. ``as_state`` gives an ``nnx.State`` snapshot
    with new Variables: editing one never edits the other.

    Attributes:
      objects: the live model and optimizer.
      graphdef: their static structure (what a compiled step is specialised on).
      treedef: the structure of their ``nnx.State``, whose leaves are the arrays.
    """

    def __init__(self, objects: dict[str, Any]) -> None:
        self.objects = objects
        self.refresh()

    def refresh(self) -> None:
        """Re-reads the structure (the user may have replaced a submodule or a Variable)."""
        self.graphdef, state = nnx.split(self.objects)
        self.treedef = jax.tree.structure(state)
        # The Variables holding an array, in leaf order; one holding optax's empty
        # MaskedNode has no leaf (its structure lives in treedef).
        self.variables: list[nnx.Variable[Any]] = [
            v for v in jax.tree.leaves(state, is_leaf=is_variable) if jax.tree.leaves(v)
        ]

    def arrays(self) -> list[jax.Array]:
        return [variable.get_raw_value() for variable in self.variables]

    def write(self, arrays: Sequence[jax.Array]) -> None:
        for variable, array in zip(self.variables, arrays, strict=True):
            # On the host, outside any trace, so no trace check is needed; set_raw_value
            # skips its own but Variable.__setattr__ makes it again (flax 0.12), a few us
            # a leaf per step. This is what set_raw_value stores, without the check.
            object.__setattr__(variable, "_raw_value", array)

    def as_state(self) -> nnx.State:
        return jax.tree.unflatten(self.treedef, self.arrays())


def leaf_shardings(shardings: Any, state: Any) -> list[Any]:
    """One sharding per array leaf of ``state``, from one per Variable.

    A Variable may hold several arrays, or none (optax's ``MaskedNode`` for a
    parameter a transformation skips): its sharding is repeated, or dropped.
    """
    per_variable = jax.tree.map(
        lambda sharding, variable: [sharding] * len(jax.tree.leaves(variable)),
        shardings,
        state,
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )
    return jax.tree.leaves(per_variable, is_leaf=lambda x: isinstance(x, NamedSharding))


def sharding_table(state: Any) -> list[dict[str, Any]]:
    """One row per array leaf: path, shape, dtype, spec, per-device shape and bytes.

    The per-device shape comes from the spec and the mesh (``sharding.shard_shape``),
    so the rows describe what each device holds. Give it ``trainer.state`` for the
    parameters and the optimizer state, or any pytree of arrays.
    """
    rows = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if not hasattr(leaf, "shape"):
            continue
        named = getattr(leaf, "sharding", None)
        spec = named.spec if isinstance(named, NamedSharding) else None
        per_device = (
            tuple(leaf.shape)
            if named is None or spec is None
            else sh.shard_shape(leaf.shape, spec, dict(named.mesh.shape))
        )
        rows.append(
            {
                "path": sh.path_str(path),
                "shape": tuple(leaf.shape),
                "dtype": str(leaf.dtype),
                "spec": "" if spec is None else str(spec),
                "shape_per_device": per_device,
                "bytes_per_device": math.prod(per_device) * leaf.dtype.itemsize,  # key<fry> too
            }
        )
    return rows
