"""Where a sampler's arrays live on the plan's mesh: the weights, the rows, the cache.

The rows are split as the plan splits a batch's rows (``Plan.batch_axes``); the key
and value caches as the strategy answers (``Strategy.cache_spec``: rows with the
batch, heads over the axes it splits attention heads over).

A layout that does not decode (a pipeline's layers split over stages, a sequence
split over devices: ``UNDECODABLE``) is resharded once per state: the weights are
copied into the same mesh without those axes (``resharded``; ``note`` says so in one
line) and traced without that strategy's context; the training state is untouched.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_spmd_trainer import sharding as sh
from nnx_spmd_trainer.planner.plan import Plan

__all__ = ["UNDECODABLE", "DecodeLayout"]

#: The mesh-axis roles whose layouts do not decode, and what they are called.
UNDECODABLE = {"stage": "a pipeline", "seq": "a sequence split"}


class DecodeLayout:
    """The layout of ``model``'s decoding on ``plan.mesh`` (the live model is read only)."""

    def __init__(self, model: nnx.Module, plan: Plan) -> None:
        self.plan = plan
        mesh, roles = plan.mesh, plan.axis_roles()
        #: The mesh axes resharded away (a pipeline's, a sequence split's): ``()`` mostly.
        self.resharded = tuple(
            a for a, role in roles.items() if role in UNDECODABLE and mesh.shape.get(a, 1) > 1
        )
        #: One line saying what was resharded, or ``None``.
        self.note = None
        if self.resharded:
            kinds = sorted({UNDECODABLE[roles[a]] for a in self.resharded})
            self.note = (
                f"{plan.strategy!r} lays the model out as {' and '.join(kinds)}, which does not "
                f"decode: sampling from a copy of the weights without the {self.resharded} "
                "axes (the training state is untouched)."
            )
        #: The mesh axes that split the rows.
        self.row_axes = tuple(
            a for a in plan.batch_axes() if a not in self.resharded and mesh.shape.get(a, 1) > 1
        )
        #: Whether the mesh's axes are Explicit (shardings are part of the types).
        self.explicit = AxisType.Explicit in tuple(mesh.axis_types)
        self._copied: tuple[list[int], list[Any]] | None = None
        self._placements: dict[int, NamedSharding] = {}
        # The model's variables, in the order of its state's leaves, found once: walking
        # the graph (nnx.state) costs more than a small model's whole decode. A trainer's
        # step replaces their values, not the variables, so reading them is current.
        self._variables = jax.tree.leaves(
            nnx.state(model), is_leaf=lambda x: isinstance(x, nnx.Variable)
        )

    @property
    def row_multiple(self) -> int:
        """Rows are padded to a multiple of this (the devices splitting them)."""
        return math.prod(self.plan.mesh.shape[a] for a in self.row_axes)

    def rows(self, *rest: Any) -> NamedSharding:
        """Rows split, the other ``rest`` dimensions as given."""
        return NamedSharding(self.plan.mesh, P(self.row_axes or None, *rest))

    def state_leaves(self) -> list[Any]:
        """The model's arrays now (the trainer's steps replace them), copied into a layout
        that decodes when the training layout does not (once per state)."""
        live = [_value(v) for v in self._variables]
        if not self.resharded:
            return live
        ids = [id(x) for x in live]
        if self._copied is None or self._copied[0] != ids:
            self._copied = (
                ids,
                [jax.device_put(x, self._decodable(x.sharding, x.ndim)) for x in live],
            )
        return self._copied[1]

    def _decodable(self, sharding: NamedSharding, ndim: int) -> NamedSharding:
        dims = sh.dimension_axes(sharding.spec, ndim)
        kept = [tuple(a for a in axes if a not in self.resharded) or None for axes in dims]
        return NamedSharding(self.plan.mesh, P(*kept))

    def abstract_state(self) -> list[jax.ShapeDtypeStruct]:
        return [
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in self.state_leaves()
        ]

    @contextlib.contextmanager
    def tracing(self, batch_shardings: Any) -> Iterator[None]:
        """The plan's trace context; none where the layout was resharded (a pipeline's
        schedule or a sequence split's rules would take the copy for theirs)."""
        if self.resharded:
            yield
            return
        with self.plan.trace_context(batch_shardings):
            yield

    def on_devices(self, *arrays: Any) -> list[jax.Array]:
        """``arrays`` (host arrays of ``rows`` leading rows, or scalars) placed as the
        programs take them: the rows split, scalars replicated (one transfer call)."""
        return list(jax.device_put(list(arrays), [self._placed(np.ndim(x)) for x in arrays]))

    def _placed(self, ndim: int) -> NamedSharding:
        """An input's sharding by its rank, made once (building one costs a call's worth)."""
        if ndim not in self._placements:
            self._placements[ndim] = (
                self.rows(*(None,) * (ndim - 1)) if ndim else self.plan.replicated
            )
        return self._placements[ndim]

    def cache_sharding(self, leaf: jax.ShapeDtypeStruct) -> NamedSharding:
        """A cache leaf's layout: keys and values as the strategy answers
        (``Strategy.cache_spec``), a padding mask (``[(layers,) rows, length]`` bools) with
        the rows, an index replicated. A leaf whose type states its layout (an explicit
        mesh's model) keeps it."""
        mesh = self.plan.mesh
        declared = getattr(leaf, "sharding", None)
        if self.explicit and isinstance(declared, NamedSharding):
            return NamedSharding(mesh, declared.spec)
        rows = self.row_axes or None
        if np.dtype(leaf.dtype) == np.dtype(bool) and leaf.ndim >= 2:
            return NamedSharding(mesh, P(*(None,) * (leaf.ndim - 2), rows, None))
        sizes = {a: n for a, n in mesh.shape.items() if a not in self.resharded}
        return NamedSharding(mesh, self.plan.strategy.cache_spec(tuple(leaf.shape), sizes))

    def bytes_per_device(self, leaves: list[jax.ShapeDtypeStruct]) -> int:
        """The bytes each device holds of ``leaves`` laid out by ``cache_sharding``."""
        total = 0
        for leaf in leaves:
            shard = self.cache_sharding(leaf).shard_shape(leaf.shape)
            total += math.prod(shard) * np.dtype(leaf.dtype).itemsize
        return total


def _value(variable: nnx.Variable[Any]) -> Any:
    """A variable's array as its state holds it (``get_value`` copies its tree and runs
    its hooks: more than the array a program takes; a reference is read)."""
    value = variable.get_raw_value()
    return value if isinstance(value, jax.Array) else variable.get_value()
