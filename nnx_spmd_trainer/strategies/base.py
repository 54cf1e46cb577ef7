"""Strategy: a small immutable object that answers three layout questions.

1. ``state_shardings`` -- what sharding does each state leaf get at init?
2. ``batch_sharding`` -- what sharding does the global batch get?
3. ``compile_step`` -- how is a step function jitted?

It never runs the loop; the Trainer asks and acts. Subclass any strategy and
override one of the three to change only that answer.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import jax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_spmd_trainer import sharding as sh

Axes = tuple[tuple[str, int], ...]


def _is_variable(x: object) -> bool:
    return isinstance(x, nnx.Variable)


@dataclasses.dataclass(frozen=True)
class Strategy:
    """Base class: one mesh axis, optional logical-axis rules, default answers.

    Attributes:
      size: devices along this strategy's mesh axis; -1 means "all left".
      axis: the mesh axis name.
      rules: extra logical-axis rules, merged over the strategy's defaults.
    """

    size: int = -1
    axis: str = "data"
    rules: sh.Rules = dataclasses.field(default=(), kw_only=True)

    #: Whether the batch is split along this strategy's axis.
    shards_batch: ClassVar[bool] = True
    #: Logical axis names this strategy maps onto its own mesh axis by default.
    logical_axes: ClassVar[tuple[str, ...]] = ()

    # -- composition: what a Hybrid joins ----------------------------------
    def mesh_axes(self) -> Axes:
        """(axis name, size) pairs this strategy contributes to the mesh."""
        return ((self.axis, self.size),)

    def batch_axes(self) -> tuple[str, ...]:
        """Mesh axes that split the leading batch dimension."""
        return (self.axis,) if self.shards_batch else ()

    def logical_rules(self) -> sh.Rules:
        """Logical name -> mesh axis; every known logical name is present."""
        user = dict(sh.merge_rules(self.rules))
        # A renamed axis (TensorParallel(axis="tp")) still honours its usual physical
        # name in annotations ("model"), read as a logical name for the new axis.
        default_axis = type(self).__dataclass_fields__["axis"].default
        usual = (default_axis,) if self.axis != default_axis else ()
        own = ((n, self.axis) for n in (*self.logical_axes, *usual) if n not in user)
        return sh.merge_rules(user.items(), own, ((n, None) for n in sh.LOGICAL_AXES))

    def refine_spec(self, spec: P, shape: tuple[int, ...], mesh: dict[str, int]) -> P:
        """Adjusts a resolved spec (FSDP shards what is left); default: as is."""
        del shape, mesh
        return spec

    # -- the mesh ------------------------------------------------------------
    def make_mesh(self, devices: Sequence[jax.Device] | None = None) -> Mesh:
        """Builds the mesh (Auto axis types: the compiler propagates shardings)."""
        devices = list(jax.devices() if devices is None else devices)
        names = [name for name, _ in self.mesh_axes()]
        sizes = [size for _, size in self.mesh_axes()]
        if len(set(names)) != len(names):
            raise sh.ShardingError(
                f"{self!r} uses a mesh axis name twice ({names}); give each member its own axis=."
            )
        if sizes.count(-1) > 1:
            raise sh.ShardingError(
                f"{self!r}: only one axis may have size=-1 ('all devices left'); "
                f"axes {dict(zip(names, sizes, strict=True))}."
            )
        known = math.prod(s for s in sizes if s != -1)
        if -1 in sizes and known > 0 and len(devices) % known == 0:
            sizes = [len(devices) // known if s == -1 else s for s in sizes]
        if any(s < 1 for s in sizes) or math.prod(sizes) != len(devices):
            asked = dict(zip(names, sizes, strict=True))
            raise sh.ShardingError(
                f"{self!r} asks for a mesh {asked} that does not fit the {len(devices)} "
                f"available devices. Choose sizes whose product is {len(devices)}, or "
                "size=-1 for one axis."
            )
        return jax.make_mesh(
            tuple(sizes), tuple(names), axis_types=(AxisType.Auto,) * len(names), devices=devices
        )

    # -- question 1: init ----------------------------------------------------
    def leaf_spec(
        self,
        variable: nnx.Variable[Any],
        mesh: dict[str, int],
        path: str = "",
    ) -> P:
        """The spec of one abstract state leaf, from its metadata and shape."""
        shape = tuple(variable.get_value().shape)
        metadata = variable.get_metadata()
        resolve = functools.partial(
            sh.resolve_spec,
            shape=shape,
            mesh=mesh,
            rules=(*self.logical_rules(), ("batch", self.batch_axes())),
            leaf_rules=tuple(metadata.get("sharding_rules") or ()),
            path=path,
        )
        try:
            spec = resolve(metadata.get("out_sharding"))
        except sh.ShardingError:
            if isinstance(variable, nnx.Param):
                raise
            # Optimizer state inherits its parameter's annotation even when its shape
            # differs (Adafactor's factored moments): lay it out as unannotated instead.
            spec = resolve(None)
        return self.refine_spec(spec, shape, mesh)

    def state_shardings(self, abstract_state: nnx.State, mesh: Mesh) -> nnx.State:
        """A NamedSharding for every leaf of ``abstract_state`` (from ``nnx.eval_shape``).

        Optimizer moments carry their parameter's metadata, so they get the
        same spec; scalars (step counters, RNG keys) are replicated.
        """
        axes = dict(mesh.shape)

        def one(path: Sequence[Any], variable: nnx.Variable[Any]) -> NamedSharding:
            return NamedSharding(mesh, self.leaf_spec(variable, axes, sh.path_str(path)))

        return jax.tree_util.tree_map_with_path(one, abstract_state, is_leaf=_is_variable)

    # -- question 2: batch placement ------------------------------------------
    def batch_sharding(self, batch: Any, mesh: Mesh) -> Any:
        """A NamedSharding per batch leaf: leading dimension over the batch axes."""
        axes = tuple(a for a in self.batch_axes() if a in mesh.shape)
        spec = P(axes) if axes else P()
        return jax.tree.map(lambda _: NamedSharding(mesh, spec), batch)

    # -- question 3: step compilation -----------------------------------------
    def compile_step(
        self,
        step_fn: Callable[..., Any],
        *,
        in_shardings: Any,
        out_shardings: Any,
        donate_argnums: tuple[int, ...] = (),
    ) -> Callable[..., Any]:
        """Jits ``step_fn`` with explicit layouts; donated inputs are reused in place."""
        return jax.jit(
            step_fn,
            in_shardings=in_shardings,
            out_shardings=out_shardings,
            donate_argnums=donate_argnums,
        )

    def __repr__(self) -> str:
        size = "" if self.size == -1 else str(self.size)
        return f"{type(self).__name__}({size})"
