"""Which mesh axes split a layer while a step is traced: the logical rules in force
(Flax's ``nnx.logical_axis_rules`` context, then the trainer's ``tracing_rules``) read
on the mesh being traced. How ``moe`` finds its expert axis, ``attention`` its sequence
axis and the dropless MoE the axes of its rows."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
from flax.core import spmd as flax_spmd

from nnx_spmd_trainer import sharding as sh

__all__ = ["traced_axes", "tracing_rules"]

#: Rules the trainer puts in force for the library's own layers while it traces a step
#: (``tracing_rules``), read by ``traced_axes`` after Flax's. Not Flax's: there a rule for
#: ``batch`` alone would make a user's ``with_logical_constraint(x, ("batch", "embed"))``
#: replicate ``embed``, where it does nothing without rules.
_TRACING_RULES: contextvars.ContextVar[sh.Rules] = contextvars.ContextVar("tracing", default=())


@contextlib.contextmanager
def tracing_rules(rules: sh.Rules) -> Iterator[None]:
    """Inside the block ``traced_axes`` also reads ``rules`` (Flax's context first)."""
    token = _TRACING_RULES.set(rules)
    try:
        yield
    finally:
        _TRACING_RULES.reset(token)


def traced_axes(*logical: str) -> tuple[str, ...]:
    """The mesh axes of size > 1 that the first of ``logical`` with a rule in force maps to,
    on the mesh being traced: how a layer learns, inside a step, which axes split it."""
    rules = {**dict(_TRACING_RULES.get()), **dict(flax_spmd.get_logical_axis_rules())}
    target = next((rules[n] for n in logical if rules.get(n) is not None), None)
    names = () if target is None else (target,) if isinstance(target, str) else tuple(target)
    mesh = jax.sharding.get_abstract_mesh()
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True)) if mesh.axis_names else {}
    return tuple(n for n in names if sizes.get(n, 1) > 1)
