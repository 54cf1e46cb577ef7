"""Annotations + logical-axis rules -> PartitionSpec, with named errors.

Pure functions over shapes, axis names and sizes: no devices needed, so every
rule here is unit-tested against a plain ``{axis: size}`` mapping.

Resolution of one annotated name, in order:

1. the leaf's own ``sharding_rules`` (attached with ``nnx.with_metadata``);
2. a physical mesh axis of that name;
3. the strategy's logical-axis rules;
4. a well-known physical name absent from this mesh -> replicated, so one
   annotated model runs under every strategy;
5. anything else is an unknown logical axis: an error.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from jax.sharding import PartitionSpec as P

AxisTarget = str | tuple[str, ...] | None
Rules = tuple[tuple[str, AxisTarget], ...]

#: Physical axis names the seeds and the strategies use. An annotation naming
#: one that the current mesh lacks replicates that dimension.
PHYSICAL_AXES = ("data", "fsdp", "model", "batch")

#: Logical names every strategy knows; unmapped ones replicate.
LOGICAL_AXES = (
    "batch",
    "embed",
    "mlp",
    "hidden",
    "heads",
    "kv",
    "head_dim",
    "vocab",
    "seq",
    "length",
    "norm",
    "layers",
    "channels",
    "features",
    "experts",
)


class ShardingError(ValueError):
    """A layout that cannot work: the message names the leaf, shape, spec and mesh."""


def merge_rules(*rule_sets: Iterable[tuple[str, AxisTarget]]) -> Rules:
    """Merges rule sets; a name mapped to two different targets is an error.

    A name mapped to ``None`` by one set gives way to a set that maps it to an
    axis, so members of a ``Hybrid`` only need to name what they shard.

    >>> merge_rules([("embed", "fsdp")], [("mlp", "model"), ("embed", None)])
    (('embed', 'fsdp'), ('mlp', 'model'))
    """
    merged: dict[str, AxisTarget] = {}
    for rules in rule_sets:
        for name, target in rules:
            previous = merged.get(name)
            if previous is not None and target is not None and previous != target:
                raise ShardingError(
                    f"Logical axis {name!r} is mapped to {previous!r} and to {target!r} by "
                    "two strategies. Give one of them explicit rules= so each logical axis "
                    "maps to one mesh axis."
                )
            if previous is None:
                merged[name] = target
    return tuple(merged.items())


def _axis_names(target: AxisTarget) -> tuple[str, ...]:
    if target is None:
        return ()
    return (target,) if isinstance(target, str) else tuple(target)


def _describe(path: str, shape: Sequence[int], annotation: object, mesh: Mapping[str, int]) -> str:
    where = path or "<leaf>"
    return (
        f"parameter {where} with shape {tuple(shape)}, annotation {annotation}, mesh {dict(mesh)}"
    )


def resolve_spec(
    annotation: Sequence[AxisTarget] | None,
    *,
    shape: Sequence[int],
    mesh: Mapping[str, int],
    rules: Rules = (),
    leaf_rules: Rules = (),
    path: str = "",
) -> P:
    """Turns a leaf's annotation into a PartitionSpec valid on ``mesh``.

    Args:
      annotation: the leaf's ``out_sharding`` metadata (physical or logical
        names, ``None`` for a replicated dimension), or ``None``.
      shape: the leaf's shape.
      mesh: mesh axis name -> size.
      rules: the strategy's logical-axis rules.
      leaf_rules: the leaf's own ``sharding_rules`` metadata; they win.
      path: the leaf's path, for error messages.

    >>> resolve_spec(("embed", "mlp"), shape=(8, 16), mesh={"model": 2},
    ...              rules=(("embed", None), ("mlp", "model")))
    PartitionSpec(None, 'model')
    """
    if annotation is None:
        return P()
    annotation = tuple(annotation)
    if len(annotation) > len(shape):
        raise ShardingError(
            f"{_describe(path, shape, annotation, mesh)}: the annotation has more entries "
            "than the array has dimensions. Give one entry per dimension."
        )
    leaf_table = dict(leaf_rules)
    rule_table = dict(rules)
    used: set[str] = set()
    entries: list[AxisTarget] = []
    for dim, name in enumerate(annotation):
        axes: list[str] = []
        for part in _axis_names(name):
            for axis in _resolve_name(part, mesh, rule_table, leaf_table, path, shape, annotation):
                if axis not in used:  # an axis may shard only one dimension
                    axes.append(axis)
                    used.add(axis)
        size = math.prod(mesh[a] for a in axes)
        if shape[dim] % size:
            raise ShardingError(
                f"{_describe(path, shape, annotation, mesh)}: dimension {dim} of size "
                f"{shape[dim]} is not divisible by mesh axes {tuple(axes)} of size {size}. "
                "Change the layer size or the strategy's axis size so it divides."
            )
        entries.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return _trim(entries)


def _resolve_name(
    name: str,
    mesh: Mapping[str, int],
    rules: Mapping[str, AxisTarget],
    leaf_rules: Mapping[str, AxisTarget],
    path: str,
    shape: Sequence[int],
    annotation: object,
) -> tuple[str, ...]:
    if name in leaf_rules:
        return tuple(a for a in _axis_names(leaf_rules[name]) if a in mesh)
    if name in mesh:
        return (name,)
    if name in rules:
        return tuple(a for a in _axis_names(rules[name]) if a in mesh)
    if name in PHYSICAL_AXES:
        return ()
    raise ShardingError(
        f"{_describe(path, shape, annotation, mesh)}: unknown axis name {name!r}. It is "
        f"neither a mesh axis ({', '.join(mesh)}) nor a logical axis with a rule "
        f"(known: {', '.join(sorted(set(rules)))}). Add a rule such as "
        f"({name!r}, 'model') to the strategy's rules= or to the leaf's sharding_rules."
    )


def path_str(path: Sequence[Any]) -> str:
    """A pytree key path as ``"model/layers/0/kernel"``, for messages and tables."""
    parts = (getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)
    return "/".join(str(p) for p in parts if p != "value")  # "value": the Variable wrapper


def _trim(entries: list[AxisTarget]) -> P:
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def spec_axes(spec: P) -> set[str]:
    """All mesh axes a spec uses."""
    return {a for entry in spec for a in _axis_names(entry)}


def shard_largest_dim(spec: P, shape: Sequence[int], axis: str, axis_size: int) -> P:
    """Adds ``axis`` to the largest unsharded dimension it divides (FSDP's fallback).

    Leaves the spec unchanged if it already uses ``axis`` or no free dimension
    divides. Ties go to the leading dimension.

    >>> shard_largest_dim(P(None, "model"), (64, 32), "fsdp", 4)
    PartitionSpec('fsdp', 'model')
    """
    if axis in spec_axes(spec):
        return spec
    entries: list[AxisTarget] = list(spec) + [None] * (len(shape) - len(spec))
    free = [d for d in range(len(shape)) if entries[d] is None and shape[d] % axis_size == 0]
    if not free:
        return spec
    best = max(free, key=lambda d: (shape[d], -d))
    entries[best] = axis
    return _trim(entries)


def shard_shape(shape: Sequence[int], spec: P, mesh: Mapping[str, int]) -> tuple[int, ...]:
    """The per-device shape of an array of ``shape`` laid out as ``spec``."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    return tuple(
        dim // math.prod(mesh[a] for a in _axis_names(entry))
        for dim, entry in zip(shape, entries, strict=True)
    )
