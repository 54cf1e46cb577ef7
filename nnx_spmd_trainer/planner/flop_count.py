"""The FLOPs of a step's matrix multiplies, counted from its jaxpr.

XLA's cost analysis counts a loop's body once (a ``lax.scan`` over 12 stacked layers:
one layer's FLOPs; measured on the TPU compiler and on XLA's own HLO, while the CPU
compiler's count includes every iteration), and XLA's GPU compiler gives no cost
analysis for GPUs described, not present. The matrix multiplies of the step's jaxpr,
each scan's body times its length, are the FLOPs that bound a step's compute on any
chip, and what a model-FLOPs utilisation counts.
"""

from __future__ import annotations

import math
from typing import Any

from jax.extend import core

__all__ = ["matmul_flops"]

#: Equation parameters that hold a sub-jaxpr run once per execution of the equation.
_INNER = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def _jaxprs(value: Any) -> list[Any]:
    if isinstance(value, core.ClosedJaxpr):
        return [value.jaxpr]
    if isinstance(value, core.Jaxpr):
        return [value]
    return []


def _dot(eqn: Any) -> float:
    """``2 x`` the left operand's size ``x`` the right's dimensions that are neither
    contracted nor batch: one multiply-add per output element and contracted index."""
    lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
    (_, rhs_contract), (_, rhs_batch) = eqn.params["dimension_numbers"]
    free = [d for i, d in enumerate(rhs) if i not in (*rhs_contract, *rhs_batch)]
    return 2.0 * math.prod(lhs) * math.prod(free)


def _shards(eqn: Any) -> int:
    """How many copies of a ``shard_map`` body run: the product of its manual axes."""
    mesh = eqn.params.get("mesh")
    names = eqn.params.get("manual_axes") or eqn.params.get("axis_names") or ()
    if mesh is None:
        return 1
    shape = dict(mesh.shape)
    return math.prod(shape.get(name, 1) for name in names)


def matmul_flops(jaxpr: Any) -> float:
    """The FLOPs (2 per multiply-add) of every ``dot_general`` in ``jaxpr`` (a ``Jaxpr``
    or ``ClosedJaxpr``), over the whole program: a ``scan``'s body times its length,
    a ``cond``'s largest branch, a ``while`` loop's body once (its trip count is not in
    the jaxpr), a ``shard_map``'s body once per shard.

    >>> import jax, jax.numpy as jnp
    >>> f = lambda a, b: a @ b
    >>> matmul_flops(jax.make_jaxpr(f)(jnp.ones((4, 8)), jnp.ones((8, 16))))
    1024.0
    >>> g = lambda a, b: jax.lax.scan(lambda c, _: (c @ b, None), a, None, length=3)[0]
    >>> matmul_flops(jax.make_jaxpr(g)(jnp.ones((4, 8)), jnp.ones((8, 8))))
    1536.0
    """
    total = 0.0
    for eqn in _jaxprs(jaxpr)[0].eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            total += _dot(eqn)
        elif name == "scan":
            total += eqn.params["length"] * matmul_flops(eqn.params["jaxpr"])
        elif name == "cond":
            total += max((matmul_flops(b) for b in eqn.params["branches"]), default=0.0)
        elif name == "while":
            total += matmul_flops(eqn.params["body_jaxpr"])
        else:
            inner = [j for key in _INNER for j in _jaxprs(eqn.params.get(key))]
            copies = _shards(eqn) if name == "shard_map" else 1
            total += copies * sum(matmul_flops(j) for j in inner)
    return total
