"""Hybrid: compose strategies like ``optax.chain``: axes joined, rules merged."""

from __future__ import annotations

import dataclasses

from jax.sharding import PartitionSpec as P

from nnx_spmd_trainer import sharding as sh
from nnx_spmd_trainer.strategies.base import Axes, Strategy


@dataclasses.dataclass(frozen=True, init=False, repr=False)
class Hybrid(Strategy):
    """One mesh axis per member; a logical axis two members map differently is an error.

    >>> Hybrid(FSDP(4), TensorParallel(2)).mesh_axes()
    (('fsdp', 4), ('model', 2))
    """

    members: tuple[Strategy, ...] = ()

    def __init__(self, *members: Strategy, rules: sh.Rules = ()) -> None:
        if not members:
            raise ValueError(
                "Hybrid needs at least one strategy, e.g. Hybrid(FSDP(4), TensorParallel(2))."
            )
        object.__setattr__(self, "members", tuple(members))
        object.__setattr__(self, "rules", rules)
        object.__setattr__(self, "size", -1)
        object.__setattr__(self, "axis", "")

    def mesh_axes(self) -> Axes:
        return tuple(axis for m in self.members for axis in m.mesh_axes())

    def batch_axes(self) -> tuple[str, ...]:
        return tuple(axis for m in self.members for axis in m.batch_axes())

    def logical_rules(self) -> sh.Rules:
        user = dict(sh.merge_rules(self.rules))  # the Hybrid's own rules override members'
        members = ([(n, t) for n, t in m.logical_rules() if n not in user] for m in self.members)
        return sh.merge_rules(user.items(), *members)

    def refine_spec(self, spec: P, shape: tuple[int, ...], mesh: dict[str, int]) -> P:
        for member in self.members:
            spec = member.refine_spec(spec, shape, mesh)
        return spec

    def __repr__(self) -> str:
        return f"Hybrid({', '.join(map(repr, self.members))})"
