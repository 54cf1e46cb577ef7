"""Strategy: the abstract contract, the questions the Plan asks and their default answers.

A strategy is a small immutable object; it never runs the loop. It answers
six questions:

1. ``state_shardings(abstract_state, mesh, proposed=None)`` -- what sharding
   does each state leaf get at init?
2. ``batch_sharding(batch, mesh, proposed=None)`` -- what sharding does the
   global batch get?
3. ``compile_step(step_fn, *, in_shardings, out_shardings, donate_argnums, jit=jax.jit)``
   -- how is a step function jitted?
4. ``data_shard(mesh, process_index=None, *, process_ids=None, proposed=None)``
   -- which slice of the data does this process feed? (follows the answer to 2.)
5. ``trace_context(mesh)`` -- what context is in force while a step is traced?
6. ``transform_step(step_fn)`` -- what step function is compiled?

One rule composes them all: every question takes the answer so far and
returns the next one, as an ``optax.chain`` transform takes the updates so
far. The answer so far is ``proposed=`` (1, 2, 4; ``None`` alone: resolve
from scratch), the rest of the chain for 3 (``jit=``), the enclosing context
for 5 and the step already wrapped for 6. ``Hybrid`` asks every member each
question in member order, the first member's answer proposed to the second
and so on (for 3, 5 and 6 the first member is outermost). So subclass a
strategy, override one question, accept what the default accepts and start
from ``super()``'s answer: the change takes effect alone and inside a Hybrid,
which refuses at construction a member whose override cannot take the answer
so far. The helpers ``make_mesh``, ``leaf_spec`` and ``annotated_shardings``
are not questions and are final.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, final

import jax
import numpy as np
from flax import nnx
from flax.core import spmd as flax_spmd
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_spmd_trainer import data_shard as ds
from nnx_spmd_trainer import sharding as sh
from nnx_spmd_trainer.strategies import axis_types as modes
from nnx_spmd_trainer.strategies import host_axes as hosts

Axes = tuple[tuple[str, int], ...]
#: What compiles a step: ``jax.jit``, or the rest of a Hybrid's chain ending in it.
Jit = Callable[..., Callable[..., Any]]


def _device_mesh(
    sizes: tuple[int, ...], names: tuple[str, ...], types: Any, devices: list[jax.Device]
) -> Mesh:
    """``jax.make_mesh``, or where its assignment of the axes to a TPU torus fails (a
    4-way axis on a 16x16 v6e slice: no product of whole physical axes is 4), the same
    mesh with a physical axis split between logical ones, which ``make_mesh`` allows on
    v5e only (``mesh_utils.create_device_mesh(allow_split_physical_axes=True)``): each
    logical axis still runs along neighbouring chips."""
    try:
        return jax.make_mesh(sizes, names, axis_types=types, devices=devices)
    except (ValueError, NotImplementedError) as error:
        if "allow_split_physical_axes" not in str(error):
            raise
    arranged = mesh_utils.create_device_mesh(sizes, devices, allow_split_physical_axes=True)
    return Mesh(arranged, names, axis_types=types)


def is_variable(x: object) -> bool:
    """Whether ``x`` is an ``nnx.Variable``: the leaf of a state tree walked per variable."""
    return isinstance(x, nnx.Variable)


def context_rules() -> sh.Rules:
    """The rules of the enclosing ``with nnx.logical_axis_rules([...]):``, else ``()``."""
    return tuple(
        (name, tuple(target) if isinstance(target, list) else target)
        for name, target in flax_spmd.get_logical_axis_rules()
    )


class Strategy(abc.ABC):
    """The contract: three composition helpers to define, six questions answered.

    A subclass defines ``mesh_axes``, ``batch_axes`` and ``logical_rules``
    (``AxisStrategy`` does, for one mesh axis) and inherits the default
    answers: state laid out from its annotations, the batch's rows split over
    the batch axes, the rows fed from that split, the step compiled with
    ``jax.jit``, no trace context, the step as is. Each question receives the
    answer so far and a default keeps it (see the module docstring). Override
    a question with the same parameters and start from ``super()``'s answer
    to change only part of it.

    >>> from nnx_spmd_trainer import DataParallel
    >>> class Announce(DataParallel):
    ...     def compile_step(self, step_fn, *, jit=jax.jit, **layout):
    ...         print("compiling", step_fn.__name__)
    ...         return super().compile_step(step_fn, jit=jit, **layout)
    >>> _ = Announce().compile_step(abs, in_shardings=None, out_shardings=None)
    compiling abs
    """

    #: The type of every mesh axis: ``"auto"`` (the compiler propagates shardings) or
    #: ``"explicit"`` (shardings are part of the types: models written with
    #: ``jax.sharding.reshard`` / ``out_sharding=``); see ``strategies.axis_types``.
    axis_types: modes.AxisTypes = "auto"
    #: ``(mesh axis, hosts it spans)`` pairs placing the axes on several hosts explicitly
    #: (``Hybrid(..., across_hosts={"data": 2})``); empty: per-layer axes inside a host.
    across_hosts: tuple[tuple[str, int], ...] = ()

    # -- composition: what a Hybrid joins ----------------------------------
    @abc.abstractmethod
    def mesh_axes(self) -> Axes:
        """(axis name, size) pairs this strategy contributes to the mesh; size -1: all left."""

    @abc.abstractmethod
    def batch_axes(self) -> tuple[str, ...]:
        """Mesh axes that split the leading batch dimension."""

    @abc.abstractmethod
    def logical_rules(self) -> sh.Rules:
        """Logical name -> mesh axis; every known logical name is present."""

    def refine_spec(self, spec: P, shape: tuple[int, ...], mesh: dict[str, int]) -> P:
        """Adjusts a resolved spec (FSDP shards what is left); default: as is."""
        del shape, mesh
        return spec

    # -- the mesh ------------------------------------------------------------
    @final
    def make_mesh(self, devices: Sequence[jax.Device] | None = None) -> Mesh:
        """Builds the mesh, every axis of the type ``axis_types`` says."""
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
        types = modes.mesh_axis_types(self.axis_types, len(names))
        roles, across = self.axis_roles(), dict(self.across_hosts)
        # On several hosts, per-layer axes inside a host whatever their order (host_axes).
        arranged = hosts.arrange(
            devices, dict(zip(names, sizes, strict=True)), roles, across, owner=repr(self)
        )
        if arranged is None:
            mesh = _device_mesh(tuple(sizes), tuple(names), types, devices)
        else:
            mesh = Mesh(arranged, tuple(names), axis_types=types)
        hosts.warn_per_layer_axes_across_hosts(mesh, roles, across, owner=repr(self))
        return mesh

    def axis_roles(self) -> dict[str, str]:
        """What each mesh axis carries, by its strategy's usual axis name (``"data"``,
        ``"fsdp"``, ``"model"``, ``"seq"``, ``"expert"``, ``"stage"``): on several hosts
        ``make_mesh`` keeps the per-layer ones inside a host (``strategies.host_axes``).
        Default: each axis's own name."""
        return {name: name for name, _ in self.mesh_axes()}

    # -- question 1: init ----------------------------------------------------
    @final
    def leaf_spec(
        self,
        variable: nnx.Variable[Any],
        mesh: dict[str, int],
        path: str = "",
    ) -> P:
        """The spec of one abstract state leaf, from its metadata, shape and the rules."""
        value = variable.get_value()
        if not hasattr(value, "shape"):  # a leafless placeholder (optax's MaskedNode)
            return P()
        shape = tuple(value.shape)
        metadata = variable.get_metadata()
        resolve = functools.partial(
            sh.resolve_spec,
            shape=shape,
            mesh=mesh,
            rules=(*self.logical_rules(), ("batch", self.batch_axes())),
            leaf_rules=tuple(metadata.get("sharding_rules") or ()),
            context_rules=context_rules(),
            path=path,
        )
        # Explicit mode declares a layout in the value's type (an initializer's
        # out_sharding=) instead of the metadata: read as an annotation.
        annotation = metadata.get("out_sharding") or sh.declared_spec(value)
        try:
            spec = resolve(annotation)
        except sh.ShardingError:
            if not isinstance(variable, nnx.OptState):
                raise  # a model's own leaf (Param, BatchStat, ...) must be annotated right
            # Optimizer state inherits its parameter's annotation even when its shape
            # differs (Adafactor's factored moments): lay it out as unannotated instead.
            # The parameter itself was resolved with that annotation, so no error hides.
            spec, annotation = resolve(None), None
        # A stacked leaf (scanned layers) is refined as one of its layers would be.
        return sh.refine_per_layer(
            lambda s, layer_shape: self.refine_spec(s, layer_shape, mesh), spec, shape, annotation
        )

    @final
    def annotated_shardings(
        self, abstract_state: nnx.State, mesh: Mesh, *, unresolved: bool = False
    ) -> nnx.State:
        """Every leaf's NamedSharding from its annotation: the default answer to question 1.

        An annotation that cannot be resolved raises a ``ShardingError`` naming the
        leaf; with ``unresolved``, that leaf is ``sharding.Unresolved(error)``
        instead, for a later answer to fix (a ``Hybrid`` proposes it to its members).
        """
        axes = dict(mesh.shape)

        def one(path: Sequence[Any], variable: nnx.Variable[Any]) -> NamedSharding | sh.Unresolved:
            try:
                return NamedSharding(mesh, self.leaf_spec(variable, axes, sh.path_str(path)))
            except sh.ShardingError as error:
                if not unresolved:
                    raise
                return sh.Unresolved(error)

        return jax.tree_util.tree_map_with_path(one, abstract_state, is_leaf=is_variable)

    def state_shardings(
        self, abstract_state: nnx.State, mesh: Mesh, proposed: nnx.State | None = None
    ) -> nnx.State:
        """A NamedSharding for every leaf of ``abstract_state`` (from ``nnx.eval_shape``).

        Optimizer moments carry their parameter's metadata, so they get the
        same spec; scalars (step counters, RNG keys) are replicated.

        Args:
          abstract_state: the state's shapes and metadata, or a built module's state.
          mesh: the mesh from ``make_mesh``.
          proposed: the answer so far (in a Hybrid: the joint resolution, then
            each earlier member's); kept by default, else resolved here. In a
            Hybrid, a leaf whose annotation the joint resolution could not read
            is ``sharding.Unresolved``: an override that understands it may
            replace it with a ``NamedSharding``; the Hybrid raises the leaf's
            error if no member does.
        """
        return self.annotated_shardings(abstract_state, mesh) if proposed is None else proposed

    # -- question 2: batch placement ------------------------------------------
    def batch_sharding(self, batch: Any, mesh: Mesh, proposed: Any = None) -> Any:
        """A NamedSharding per batch leaf: leading dimension over the batch axes.

        ``proposed`` is the answer so far (in a Hybrid: over every member's
        batch axes, then each earlier member's); kept by default.
        """
        if proposed is not None:
            return proposed
        axes = tuple(a for a in self.batch_axes() if a in mesh.shape)
        axes = hosts.batch_axes_outer_first(axes, mesh)  # each process feeds one block of rows
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
        jit: Jit = jax.jit,
    ) -> Callable[..., Any]:
        """Jits ``step_fn`` with explicit layouts; donated inputs are reused in place.

        ``jit`` is the rest of the chain (middleware): an override may wrap
        ``step_fn`` or change the layouts, then pass them on to ``jit``.
        """
        return jit(
            step_fn,
            in_shardings=in_shardings,
            out_shardings=out_shardings,
            donate_argnums=donate_argnums,
        )

    # -- question 4: which rows this process feeds -------------------------------
    def data_shard(
        self,
        mesh: Mesh,
        process_index: int | None = None,
        *,
        process_ids: np.ndarray | None = None,
        proposed: ds.DataShard | None = None,
    ) -> ds.DataShard:
        """Which slice of the global data ``process_index`` feeds, from ``batch_sharding``.

        The slice is along each batch leaf's fed dimension
        (``data_shard.fed_dimension``: the first dimension its spec splits, the
        rows unless the strategy splits another), read from the answer to
        question 2 for one (rows, features) leaf. A later dimension is fed
        split only over the strategy's ``batch_axes``: an axis that splits it
        without being one (``SequenceParallel``'s) gives each process that
        whole dimension, so processes holding different sequence chunks of the
        same rows feed the same rows.

        Args:
          mesh: the mesh from ``make_mesh``.
          process_index: the process asking; ``jax.process_index()`` by default.
          process_ids: the process owning each mesh device, shaped like the
            mesh; the devices' own by default. Other ids plan a multi-host
            layout from one host.
          proposed: the answer so far (in a Hybrid: the joint one, from the
            Hybrid's batch sharding, then each earlier member's); kept by default.
        """
        if proposed is not None:
            return proposed
        probe = jax.ShapeDtypeStruct((mesh.size, mesh.size), np.float32)  # a global batch leaf
        sharding = jax.tree.leaves(self.batch_sharding(probe, mesh))[0]
        if not isinstance(sharding, NamedSharding):
            raise TypeError(
                f"{self!r}.batch_sharding gave {sharding!r}; data_shard reads the mesh axes "
                "of a NamedSharding's fed dimension. Return NamedSharding(mesh, spec)."
            )
        if process_ids is None:
            process_ids = np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices)
        fed = ds.fed_dimension(sharding.spec)
        axes = fed.axes if fed.dim == 0 else tuple(a for a in fed.axes if a in self.batch_axes())
        return ds.data_shard_of(
            process_ids,
            mesh.axis_names,
            axes,
            jax.process_index() if process_index is None else process_index,
        )

    # -- question 5: what is in force while a step is traced --------------------------
    def trace_context(self, mesh: Mesh) -> contextlib.AbstractContextManager[Any]:
        """A context the trainer enters while it traces a step; default: one that
        names ``axis_types="explicit"`` when the model makes an explicit-sharding call
        on this strategy's ``Auto`` mesh (``axis_types.explicit_calls_named``).

        A strategy that constrains activations by logical name (``length``,
        ``embed``) returns ``nnx.logical_axis_rules(...)`` here, so
        ``flax.linen.with_logical_constraint`` inside the model (which reads
        the same rules; outside any, it does nothing) resolves them; enter
        ``super()``'s answer too. In a Hybrid the members' contexts nest, the
        first member's outermost.
        """
        return modes.explicit_calls_named(mesh, repr(self))

    # -- question 6: the step itself ---------------------------------------------
    def transform_step(self, step_fn: Callable[..., Any]) -> Callable[..., Any]:
        """Wraps the step function before it is compiled; default: as is.

        ``step_fn(state_arrays, metrics, batch)`` is the traced train or eval
        step; a transform returns a function of the same arguments and results
        (pipeline and context parallelism replace the step's inner loop here).
        In a Hybrid each member wraps the step the later members wrapped, so
        the first member's transform is outermost.
        """
        return step_fn

    # -- question 7: a decode cache's layout ----------------------------------------
    def cache_spec(self, shape: tuple[int, ...], mesh: dict[str, int]) -> P:
        """The layout of a decoder's key or value cache, ``[(layers,) rows, positions,
        heads, head_dim]``, on ``mesh`` (axis -> size; a sampler leaves out the axes it
        resharded away): the rows split as a batch's (``batch_axes``), the heads as this
        strategy splits attention heads (its rule for the logical ``"heads"``: tensor
        parallelism's axis), positions and head_dim whole. Heads that the axes do not
        divide, or axes the rows already use, stay whole; a leaf of another rank is
        replicated.

        >>> from nnx_spmd_trainer import FSDP, Hybrid, TensorParallel
        >>> layout = Hybrid(FSDP(4), TensorParallel(2))
        >>> layout.cache_spec((8, 32, 4, 16), {"fsdp": 4, "model": 2})
        P('fsdp', None, 'model', None)
        """
        if len(shape) < 4:
            return P()
        rows = tuple(a for a in self.batch_axes() if mesh.get(a, 1) > 1)
        target = dict(self.logical_rules()).get("heads")
        named = (target,) if isinstance(target, str) else tuple(target or ())
        heads = tuple(a for a in named if a not in rows and mesh.get(a, 1) > 1)
        if shape[-2] % math.prod(mesh[a] for a in heads):
            heads = ()
        lead = (None,) * (len(shape) - 4)
        return P(*lead, rows or None, None, heads or None, None)
