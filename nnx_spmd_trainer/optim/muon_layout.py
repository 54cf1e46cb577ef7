"""Newton-Schulz once per matrix: each matrix moved whole onto one owner, and back.

Muon orthogonalizes whole matrices. Left to XLA under FSDP, every device of the
FSDP axis gathers every matrix and runs the same iterations on all of them
(XLA:CPU even warns "Involuntary full rematerialization" for the reshard). Here the
matrices of one shape and layout are stacked into a batch, and inside one
``shard_map`` each mesh axis that splits a matrix dimension trades that split for a
split of the batch with one ``all_to_all`` (as MaxText does along the layer axis):
each device then holds whole matrices, a ``1/devices`` share of them, and runs
Newton-Schulz on those only; the reverse ``all_to_all`` puts the results back in the
parameter's layout. A mesh axis that replicates the matrices (data parallelism)
splits the batch among its devices too, and an ``all_gather`` of the results gives
every device its copy. Stacked (scanned) layers and experts are batches already: their
split axes stay where they are (an expert's matrices are orthogonalized by the
devices that hold that expert).

The layout comes from the plan: ``Plan.trace_context`` enters ``parameter_layout``
with its parameters' shardings while the step is traced. Without it (a plain
``jax.jit`` loop) the batch is orthogonalized as it lies, left to XLA.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers

#: Orthogonalizes a batch ``[n, *matrix axes]`` given its dimension numbers (axis 0 is
#: the batch): optax's ``orthogonalize_via_newton_schulz`` with Muon's settings bound.
Orthogonalize = Callable[[jax.Array, MuonDimensionNumbers], jax.Array]

PathKey = tuple[Any, ...]

_LAYOUT: contextvars.ContextVar[dict[PathKey, NamedSharding] | None] = contextvars.ContextVar(
    "muon_parameter_layout", default=None
)


def path_key(path: Sequence[Any]) -> PathKey:
    """A tree path as plain names (``('blocks', 0, 'linear1', 'kernel')``): the same for
    the optimizer's pure parameter tree and the plan's tree of Variables (whose paths end
    in ``.value``)."""
    if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "value":
        path = path[:-1]
    return tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path)


@contextlib.contextmanager
def parameter_layout(shardings: Any) -> Iterator[None]:
    """While a step is traced: the parameters' ``NamedSharding`` s (a tree whose paths
    are the parameters' paths), read by the sharded Muon to place its matrices."""
    flat = jax.tree_util.tree_flatten_with_path(
        shardings, is_leaf=lambda x: isinstance(x, NamedSharding)
    )[0]
    found = {path_key(p): s for p, s in flat if isinstance(s, NamedSharding)}
    token = _LAYOUT.set(found)
    try:
        yield
    finally:
        _LAYOUT.reset(token)


def current_layout() -> dict[PathKey, NamedSharding] | None:
    """The parameters' shardings by path, while a plan traces a step; else None."""
    return _LAYOUT.get()


def _normalized(ndim: int, dims: MuonDimensionNumbers) -> tuple[tuple[int, ...], tuple[int, ...]]:
    def axes(a: Sequence[int] | int) -> tuple[int, ...]:
        return tuple(x % ndim for x in ((a,) if isinstance(a, int) else a))

    return axes(dims.reduction_axis), axes(dims.output_axis)


def _spec_entries(spec: P, ndim: int) -> tuple[tuple[str, ...], ...]:
    """The mesh axes splitting each dimension, ``()`` where none does."""
    entries = tuple(spec) + (None,) * (ndim - len(spec))
    return tuple(() if e is None else ((e,) if isinstance(e, str) else tuple(e)) for e in entries)


class MatrixGroup:
    """Leaves of one shape, dtype, layout and dimension numbers, orthogonalized as one
    batch of matrices in one ``shard_map``.

    Attributes:
      mesh_axes_on_matrix: per matrix dimension (in axis order), the mesh axes that split it.
      replicating_axes: the mesh axes (size > 1) along which the leaves are copies.
      owners: how many devices share the group's matrices (each owns ``1/owners``).
    """

    def __init__(
        self, shape: tuple[int, ...], dims: MuonDimensionNumbers, sharding: NamedSharding
    ) -> None:
        self.shape, self.sharding, self.mesh = shape, sharding, sharding.mesh
        ndim = len(shape)
        self.reduction, self.output = _normalized(ndim, dims)
        self.matrix_axes = tuple(sorted(self.reduction + self.output))
        self.batch_axes = tuple(a for a in range(ndim) if a not in self.matrix_axes)
        entries = _spec_entries(sharding.spec, ndim)
        self.spec = P(*[e if e else None for e in entries])
        self.mesh_axes_on_matrix = tuple(entries[a] for a in self.matrix_axes)
        used = {name for e in entries for name in e}
        sizes = dict(self.mesh.shape)
        self.replicating_axes = tuple(
            n for n in self.mesh.axis_names if n not in used and sizes[n] > 1
        )
        self.moving = math.prod(sizes[n] for e in self.mesh_axes_on_matrix for n in e)
        self.replicas = math.prod(sizes[n] for n in self.replicating_axes)
        self.owners = self.moving * self.replicas

    def local_dims(self) -> MuonDimensionNumbers:
        """The dimension numbers of a ``[n, *matrix axes]`` batch (axis 0 the batch)."""
        position = {a: 1 + i for i, a in enumerate(self.matrix_axes)}
        return MuonDimensionNumbers(
            tuple(position[a] for a in self.reduction), tuple(position[a] for a in self.output)
        )

    def orthogonalize(self, leaves: list[jax.Array], ortho: Orthogonalize) -> list[jax.Array]:
        """Each leaf's matrices orthogonalized, laid out as the leaves are."""
        count, specs = len(leaves), [self.spec] * len(leaves)
        run = jax.shard_map(
            lambda *xs: self._local(list(xs), ortho),
            mesh=self.mesh,
            in_specs=tuple(specs),
            out_specs=tuple(specs),
            check_vma=False,  # the replicating axes' copies are made equal by all_gather
        )
        with jax.named_scope("muon_newton_schulz"):
            return list(run(*[jax.lax.with_sharding_constraint(x, self.sharding) for x in leaves]))[
                :count
            ]

    def _local(self, blocks: list[jax.Array], ortho: Orthogonalize) -> tuple[jax.Array, ...]:
        # One device's blocks, [G, *leaf's local shape] stacked, batch axes first.
        order = self.batch_axes + self.matrix_axes
        stacked = jnp.stack([b.transpose(order) for b in blocks])
        local_shape = stacked.shape
        matrix_local = local_shape[1 + len(self.batch_axes) :]
        x = stacked.reshape((-1, *matrix_local))
        n = x.shape[0]
        padded = -(-n // self.owners) * self.owners  # zeros orthogonalize to zeros
        x = jnp.pad(x, [(0, padded - n)] + [(0, 0)] * len(matrix_local))
        if self.replicas > 1:  # each copy's devices take their share of the batch
            share = padded // self.replicas
            index = jax.lax.axis_index(self.replicating_axes)
            x = jax.lax.dynamic_slice_in_dim(x, index * share, share, axis=0)
        for d, names in enumerate(self.mesh_axes_on_matrix):
            for name in reversed(names):  # the minor axis's blocks first: they are adjacent
                x = jax.lax.all_to_all(x, name, 0, 1 + d, tiled=True)
        x = ortho(x, self.local_dims())
        for d, names in reversed(list(enumerate(self.mesh_axes_on_matrix))):
            for name in names:
                x = jax.lax.all_to_all(x, name, 1 + d, 0, tiled=True)
        if self.replicas > 1:
            x = jax.lax.all_gather(x, self.replicating_axes, axis=0, tiled=True)
        x = x[:n].reshape(local_shape)
        inverse = tuple(sorted(range(len(order)), key=lambda i: order[i]))
        return tuple(x[i].transpose(inverse) for i in range(len(blocks)))


def _unlaid(x: jax.Array, dims: MuonDimensionNumbers, ortho: Orthogonalize) -> jax.Array:
    """One leaf orthogonalized as it lies (no layout known): optax's computation."""
    reduction, output = _normalized(x.ndim, dims)
    matrix = tuple(sorted(reduction + output))
    batch = tuple(a for a in range(x.ndim) if a not in matrix)
    order = batch + matrix
    moved = x.transpose(order)
    flat = moved.reshape((-1, *moved.shape[len(batch) :]))
    position = {a: 1 + i for i, a in enumerate(matrix)}
    local = MuonDimensionNumbers(
        tuple(position[a] for a in reduction), tuple(position[a] for a in output)
    )
    done = ortho(flat, local).reshape(moved.shape)
    return done.transpose(tuple(sorted(range(x.ndim), key=lambda i: order[i])))


def orthogonalize_tree(mu_hat: Any, dimension_numbers: Any, ortho: Orthogonalize) -> Any:
    """Every matrix leaf of ``mu_hat`` orthogonalized, grouped by shape and layout when a
    plan's ``parameter_layout`` is in force. ``dimension_numbers`` is a tree like
    ``mu_hat`` of ``MuonDimensionNumbers`` (masked leaves are empty nodes in both)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(mu_hat)
    dims = jax.tree.leaves(dimension_numbers, is_leaf=lambda d: isinstance(d, MuonDimensionNumbers))
    if len(dims) != len(flat):
        raise ValueError(
            f"Muon: {len(dims)} dimension numbers for {len(flat)} matrices; give one "
            "MuonDimensionNumbers per Muon leaf (None for the leaves AdamW trains)."
        )
    layout = current_layout()
    groups: dict[Any, list[int]] = {}
    out: list[jax.Array | None] = [None] * len(flat)
    for i, ((path, x), d) in enumerate(zip(flat, dims, strict=True)):
        sharding = layout.get(path_key(path)) if layout else None
        if sharding is None or not isinstance(sharding.mesh, Mesh):
            out[i] = _unlaid(x, d, ortho)
            continue
        spec = _spec_entries(sharding.spec, x.ndim)
        key = (x.shape, x.dtype, _normalized(x.ndim, d), spec, id(sharding.mesh))
        groups.setdefault(key, []).append(i)
    for members in groups.values():
        first = flat[members[0]][1]
        sharding = layout[path_key(flat[members[0]][0])]  # type: ignore[index]  # grouped above
        group = MatrixGroup(first.shape, dims[members[0]], sharding)
        done = group.orthogonalize([flat[i][1] for i in members], ortho)
        for i, y in zip(members, done, strict=True):
            out[i] = y
    return jax.tree_util.tree_unflatten(treedef, out)
