"""The mesh's axis types: ``"auto"`` (the compiler propagates shardings) or ``"explicit"``.

JAX has two global-view sharding modes. On an ``Auto`` mesh the compiler
chooses how every intermediate is laid out from the inputs' shardings; on an
``Explicit`` mesh (``jax.make_mesh``'s default since JAX 0.9) shardings are part
of the arrays' types (``jax.typeof(x)`` prints ``f32[8@fsdp,4]``), propagate
while the step is traced, and the model may state them itself:
``jax.sharding.reshard(x, P(...))``, ``out_sharding=`` on ``nnx.Linear``,
``jnp.dot``, initializers and ``jnp.zeros``. A model written for one mode
needs a mesh of that mode: its explicit-mode calls fail on an ``Auto`` mesh.
Every strategy takes ``axis_types=`` and builds its mesh with it;
``explicit_calls_named`` turns JAX's error for an explicit-mode call on an
``Auto`` mesh into one that names the switch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Literal, get_args

import jax
from jax.sharding import Mesh

from nnx_spmd_trainer import sharding as sh

#: What ``axis_types=`` takes: the type of every axis of the strategy's mesh.
AxisTypes = Literal["auto", "explicit"]
_MESH_TYPES: dict[str, jax.sharding.AxisType] = {
    "auto": jax.sharding.AxisType.Auto,
    "explicit": jax.sharding.AxisType.Explicit,
}

#: The words of JAX's errors for an explicit-mode call (``reshard``, ``out_sharding=``)
#: whichever call raised it: on an Auto mesh, and where no mesh is set (a model built
#: while its abstract state is traced, outside any mesh unless the mesh is explicit).
_EXPLICIT_CALL_ERRORS = (
    "cannot contain axis names that are of type Auto",
    "Using PartitionSpec when you are not under a mesh context",
)


class ExplicitModeError(sh.ShardingError):
    """A model's explicit-sharding call met an ``Auto`` mesh, or a strategy cannot run
    on an ``Explicit`` one; the message says which switch to change."""


def checked(axis_types: object, owner: str) -> AxisTypes:
    """``axis_types`` if it is ``"auto"`` or ``"explicit"``, else a ValueError naming ``owner``.

    >>> checked("explicit", "FSDP")
    'explicit'
    """
    if axis_types not in _MESH_TYPES:
        raise ValueError(
            f"{owner}: axis_types must be one of {get_args(AxisTypes)}, got {axis_types!r}. "
            '"explicit" for models written for JAX\'s explicit sharding mode (reshard, '
            'out_sharding=), "auto" (the default) for the rest.'
        )
    return axis_types  # type: ignore[return-value]  # checked just above


def mesh_axis_types(axis_types: AxisTypes, count: int) -> tuple[jax.sharding.AxisType, ...]:
    """The ``axis_types=`` of ``jax.make_mesh`` for ``count`` axes of one mode.

    >>> mesh_axis_types("explicit", 2)
    (Explicit, Explicit)
    """
    return (_MESH_TYPES[axis_types],) * count


def is_explicit(mesh: Mesh) -> bool:
    """Whether every axis of ``mesh`` is ``Explicit`` (shardings are part of the types)."""
    return bool(mesh.axis_types) and all(
        t == jax.sharding.AxisType.Explicit for t in mesh.axis_types
    )


@contextlib.contextmanager
def explicit_calls_named(mesh: Mesh, owner: str = "the strategy") -> Iterator[None]:
    """Re-raises JAX's error for an explicit-mode call on an ``Auto`` mesh as an
    ``ExplicitModeError`` naming ``axis_types="explicit"``, JAX's error chained.

    ``owner`` is the strategy whose mesh it is, as the fix names it. On an
    ``Explicit`` mesh, and for any other error, it does nothing.
    """
    try:
        yield
    except ValueError as error:
        known = isinstance(error, ExplicitModeError)  # named already (a nested context)
        ours = any(words in str(error) for words in _EXPLICIT_CALL_ERRORS)
        if known or is_explicit(mesh) or not ours:
            raise
        axes = dict(mesh.shape)
        raise ExplicitModeError(
            f"The model uses JAX's explicit sharding mode (jax.sharding.reshard, "
            f"out_sharding=, ...), but {owner}'s mesh {axes} has Auto axes, on which the "
            f'compiler chooses the layouts. Build the strategy with axis_types="explicit" '
            f'(e.g. FSDP(axis_types="explicit"), Hybrid(..., axis_types="explicit")), or '
            "drop the explicit calls from the model. JAX said: "
            f"{str(error).splitlines()[0]}"
        ) from error


@contextlib.contextmanager
def building_under(mesh: Mesh) -> Iterator[None]:
    """In force while a model is built to read its abstract state (``nnx.eval_shape``).

    An explicit mesh is set, since an explicit-mode model states shardings as it
    builds (an initializer's ``out_sharding=``), and its types then carry them
    (``sharding.declared_spec``). An Auto mesh is not: under one, ``nnx.eval_shape``
    lays every variable out by its annotation, and an annotation naming an axis this
    mesh lacks (replicated here, by design) would fail. Either way an explicit-mode
    call the mesh cannot take is named as ``explicit_calls_named`` names it.
    """
    with contextlib.ExitStack() as stack:
        if is_explicit(mesh):
            stack.enter_context(jax.set_mesh(mesh))
        stack.enter_context(explicit_calls_named(mesh))
        yield
