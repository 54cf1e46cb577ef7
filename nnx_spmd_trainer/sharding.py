"""Annotations + logical-axis rules -> PartitionSpec, with named errors.

Pure functions over shapes, axis names and sizes, unit-tested against a plain
``{axis: size}`` mapping. Which axes split a layer while a step is traced (the rules
and mesh in force) is ``nn/tracing.py``'s.

Resolution of one annotated name, in order:

1. the leaf's own ``sharding_rules`` (attached with ``nnx.with_metadata``);
2. Flax's logical-axis-rules context (``with nnx.logical_axis_rules(...):``
   around the Trainer's construction), as Flax itself lets both rename any
   name, a mesh axis name included;
3. a physical mesh axis of that name;
4. the strategy's logical-axis rules (its defaults and its ``rules=``);
5. a well-known physical name absent from this mesh -> replicated, so one
   annotated model runs under every strategy;
6. anything else is an unknown logical axis: an error.

The nearer to the leaf, the stronger: the model's author and the caller's
context know more about one model than a strategy's defaults do.

Which rows each process feeds (``data_shard_of``) lives in ``data_shard.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from jax.sharding import AxisType, NamedSharding
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


#: The logical name of a stacked-layer dimension: the leading axis that
#: ``nnx.vmap``/``nnx.scan`` with ``transform_metadata={nnx.PARTITION_NAME: "layers"}``
#: add to every annotation. Unless a rule maps it to a mesh axis it stays whole, and a
#: strategy's refinement (FSDP's fallback) lays out each layer as an unstacked leaf.
LAYERS = "layers"


class ShardingError(ValueError):
    """A layout that cannot work: the message names the leaf, shape, spec and mesh."""


class Unresolved:
    """A state leaf whose annotation the joint resolution could not read.

    A ``Hybrid`` proposes it to its members (``state_shardings(...,
    proposed=...)``) in place of that leaf's ``NamedSharding``, so a member
    that understands the annotation can answer it; if none does, the Hybrid
    raises ``error``. Reading an attribute of it as if it were a sharding
    (``.spec``, ``.mesh``) raises ``error`` too.
    """

    __slots__ = ("error",)

    def __init__(self, error: ShardingError) -> None:
        object.__setattr__(self, "error", error)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # protocol probes (copy, hasattr(x, "__...__")) stay quiet
            raise AttributeError(name)
        raise self.error

    def __repr__(self) -> str:
        return f"Unresolved({self.error})"


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
    annotation = repr(annotation) if isinstance(annotation, str) else annotation
    return (
        f"parameter {where} with shape {tuple(shape)}, annotation {annotation}, mesh {dict(mesh)}"
    )


def annotation_entries(
    annotation: object,
    *,
    shape: Sequence[int],
    mesh: Mapping[str, int],
    path: str = "",
) -> tuple[AxisTarget, ...] | None:
    """A leaf's annotation as one entry per dimension (``None`` for no annotation).

    Accepted: a tuple or list of names (``None`` for a replicated dimension, a
    tuple of names for several axes), a ``PartitionSpec``, or a
    ``NamedSharding`` (the JAX AI Stack tutorials' form), whose spec is read
    against the trainer's mesh as any other annotation is: its own mesh is not
    used. Anything else is a ``ShardingError`` naming the leaf.

    >>> annotation_entries(P(None, "model"), shape=(4, 8), mesh={"model": 2})
    (None, 'model')
    """
    if annotation is None:
        return None
    if isinstance(annotation, NamedSharding):
        annotation = annotation.spec
    wrong = f"{_describe(path, shape, annotation, mesh)}: the annotation"
    if isinstance(annotation, str) or not isinstance(annotation, (tuple, list, P)):
        hint = f" Did you mean ({annotation!r},)?" if isinstance(annotation, str) else ""
        raise ShardingError(
            f"{wrong} is of type {type(annotation).__name__}, not a sharding annotation. "
            "Give one entry per dimension: a tuple of mesh axis or logical names (None for "
            "a replicated dimension), a PartitionSpec, or a NamedSharding." + hint
        )
    entries = tuple(annotation)
    for entry in entries:
        names = entry if isinstance(entry, (tuple, list)) else (entry,)
        if entry is not None and not all(isinstance(n, str) for n in names):
            raise ShardingError(
                f"{wrong} has the entry {entry!r}; each entry is None, an axis name or a "
                "tuple of axis names."
            )
    return tuple(tuple(e) if isinstance(e, list) else e for e in entries)


def resolve_spec(
    annotation: object,
    *,
    shape: Sequence[int],
    mesh: Mapping[str, int],
    rules: Rules = (),
    leaf_rules: Rules = (),
    context_rules: Rules = (),
    path: str = "",
) -> P:
    """Turns a leaf's annotation into a PartitionSpec valid on ``mesh``.

    Args:
      annotation: the leaf's ``out_sharding`` metadata (physical or logical
        names, ``None`` for a replicated dimension; a ``PartitionSpec`` or a
        ``NamedSharding``: see ``annotation_entries``), or ``None``.
      shape: the leaf's shape.
      mesh: mesh axis name -> size.
      rules: the strategy's logical-axis rules.
      leaf_rules: the leaf's own ``sharding_rules`` metadata; they win.
      context_rules: Flax's ``nnx.logical_axis_rules`` context; after the
        leaf's own, before the mesh axes and the strategy's rules.
      path: the leaf's path, for error messages.

    >>> resolve_spec(("embed", "mlp"), shape=(8, 16), mesh={"model": 2},
    ...              rules=(("embed", None), ("mlp", "model")))
    P(None, 'model')
    """
    entries_given = annotation_entries(annotation, shape=shape, mesh=mesh, path=path)
    if entries_given is None:
        return P()
    annotation = entries_given
    if len(annotation) > len(shape):
        raise ShardingError(
            f"{_describe(path, shape, annotation, mesh)}: the annotation has more entries "
            "than the array has dimensions. Give one entry per dimension."
        )
    # One table, nearest first: a leaf rule shadows the context's, which shadows nothing
    # else here (mesh axes and strategy rules are looked at after it in _resolve_name).
    leaf_table = {**dict(context_rules), **dict(leaf_rules)}
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
    known = ", ".join(sorted({*rules, *leaf_rules}))
    raise ShardingError(
        f"{_describe(path, shape, annotation, mesh)}: unknown axis name {name!r}. It is "
        f"neither a mesh axis ({', '.join(mesh)}) nor a logical axis with a rule "
        f"(known: {known}). Add a rule such as "
        f"({name!r}, 'model') to the strategy's rules=, to the leaf's sharding_rules, or "
        "to a `with nnx.logical_axis_rules([...]):` around the Trainer's construction."
    )


def refine_per_layer(
    refine: Callable[[P, tuple[int, ...]], P],
    spec: P,
    shape: Sequence[int],
    annotation: object,
) -> P:
    """``refine(spec, shape)`` with the leaf's unsharded ``LAYERS`` dimensions taken out
    first and put back whole, so a stacked leaf is refined as one of its layers is.

    Without this, FSDP's fallback would split the layer dimension wherever it is the
    largest free one (a stacked layer norm's ``(layers, embed)``), and ``nnx.scan``
    would gather every layer's slice in each iteration.

    >>> fsdp = lambda spec, shape: shard_largest_dim(spec, shape, "fsdp", 4)
    >>> refine_per_layer(fsdp, P(None, "model"), (8, 16), ("layers", "model"))
    P(None, 'model')
    >>> refine_per_layer(fsdp, P(None, None), (8, 16), ("layers", None))
    P(None, 'fsdp')
    """
    entries = list(spec) + [None] * (len(shape) - len(spec))
    named = annotation_entries(annotation, shape=shape, mesh={}) or ()
    # Split or not (PipelineParallel splits it over its stages), the layer dimension
    # is put back as it was.
    stacked = {d for d, name in enumerate(named) if name == LAYERS}
    if not stacked:
        return refine(spec, tuple(shape))
    kept = [d for d in range(len(shape)) if d not in stacked]
    refined = refine(_trim([entries[d] for d in kept]), tuple(shape[d] for d in kept))
    inner = iter(list(refined) + [None] * (len(kept) - len(refined)))
    return _trim([entries[d] if d in stacked else next(inner) for d in range(len(shape))])


def _key_name(key: Any) -> Any:
    return getattr(key, "key", getattr(key, "name", getattr(key, "idx", key)))


def path_str(path: Sequence[Any]) -> str:
    """A pytree key path as ``"model/layers/0/kernel"``: how a state leaf is named in
    messages, path rules, ``sharding_table``, TensorBoard and checkpoint fingerprints.

    Only the ``nnx.Variable`` wrapper, a last key named ``value`` (an attribute of
    live state, a dict key of state read back by Orbax), is left out: a submodule
    named ``value`` (attention's ``mha/value/kernel``) stays.

    >>> from jax.tree_util import DictKey, GetAttrKey
    >>> path_str([DictKey("mha"), DictKey("value"), DictKey("kernel"), GetAttrKey("value")])
    'mha/value/kernel'
    """
    names = [str(_key_name(k)) for k in path]
    if names and names[-1] == "value":
        names.pop()  # the Variable wrapper
    return "/".join(names)


def _trim(entries: list[AxisTarget]) -> P:
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def declared_spec(value: Any) -> P | None:
    """The layout an explicit-mode value declares in its type, else ``None``.

    Under an ``Explicit`` mesh a model may state a parameter's sharding where it
    creates it (``init(key, shape, out_sharding=P(None, "model"))``, the Flax
    guide's explicit style) rather than in its metadata; ``jax.eval_shape``
    then gives a ``ShapeDtypeStruct`` whose sharding carries that spec.
    Only specs on an ``Explicit`` mesh that name an axis count: a value placed
    some other way says nothing about the model's intent.

    >>> import numpy as np
    >>> declared_spec(np.zeros(4)) is None  # no sharding in its type
    True
    """
    sharding = getattr(value, "sharding", None)
    if not isinstance(sharding, NamedSharding) or not spec_axes(sharding.spec):
        return None
    types = sharding.mesh.axis_types
    explicit = bool(types) and all(t == AxisType.Explicit for t in types)
    return sharding.spec if explicit else None


def spec_axes(spec: P) -> set[str]:
    """All mesh axes a spec uses."""
    return {a for entry in spec for a in _axis_names(entry)}


def shard_largest_dim(spec: P, shape: Sequence[int], axis: str, axis_size: int) -> P:
    """Adds ``axis`` to the largest unsharded dimension it divides (FSDP's fallback).

    Leaves the spec unchanged if it already uses ``axis`` or no free dimension
    divides. Ties go to the leading dimension.

    >>> shard_largest_dim(P(None, "model"), (64, 32), "fsdp", 4)
    P('fsdp', 'model')
    """
    return _shard_one_free_dim(spec, shape, axis, axis_size, lambda free: max(
        free, key=lambda d: (shape[d], -d)
    ))  # fmt: skip


def shard_last_dim(spec: P, shape: Sequence[int], axis: str, axis_size: int) -> P:
    """Adds ``axis`` to the last unsharded dimension it divides (a matrix's features:
    tensor parallelism's fallback for a large leaf nothing splits).

    Leaves the spec unchanged if it already uses ``axis`` or no free dimension divides.

    >>> shard_last_dim(P(), (50304, 32), "model", 2)
    P(None, 'model')
    >>> shard_last_dim(P(), (64, 3), "model", 2)
    P('model',)
    """
    return _shard_one_free_dim(spec, shape, axis, axis_size, lambda free: free[-1])


def _shard_one_free_dim(
    spec: P,
    shape: Sequence[int],
    axis: str,
    axis_size: int,
    choose: Callable[[list[int]], int],
) -> P:
    """``axis`` added to the dimension ``choose`` picks among the unsharded ones it divides;
    ``spec`` as it is if it already uses ``axis`` or none divides."""
    if axis in spec_axes(spec):
        return spec
    entries: list[AxisTarget] = list(spec) + [None] * (len(shape) - len(spec))
    free = [d for d in range(len(shape)) if entries[d] is None and shape[d] % axis_size == 0]
    if not free:
        return spec
    entries[choose(free)] = axis
    return _trim(entries)


def shard_shape(shape: Sequence[int], spec: P, mesh: Mapping[str, int]) -> tuple[int, ...]:
    """The per-device shape of an array of ``shape`` laid out as ``spec``."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    return tuple(
        dim // math.prod(mesh[a] for a in _axis_names(entry))
        for dim, entry in zip(shape, entries, strict=True)
    )


def dimension_axes(spec: P, ndim: int | None = None) -> tuple[tuple[str, ...], ...]:
    """The mesh axes splitting each dimension of a spec (``ndim`` entries, padded with ``()``).

    >>> dimension_axes(P(None, ("data", "model")), 3)
    ((), ('data', 'model'), ())
    """
    entries = [_axis_names(entry) for entry in spec]
    return tuple(entries + [()] * ((len(entries) if ndim is None else ndim) - len(entries)))
