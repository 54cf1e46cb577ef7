"""WeightMap: each model array as an expression over a file's tensors, and the one check
that compares a map, a model and a source before anything is read."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import jax
import numpy as np

from nnx_spmd_trainer.sharding import path_str
from nnx_spmd_trainer.weights.expr import Expr, Tensor, tensor
from nnx_spmd_trainer.weights.sources import WeightSource

__all__ = ["WeightMap", "WeightsMismatch", "check"]


class WeightsMismatch(ValueError):
    """Weights that do not fit: every problem found, in one message, before any array
    was built. ``problems`` maps a kind (``"missing"``, ``"unexpected"``, ``"shape"``,
    ``"dtype"``, ``"damaged"``, ``"map"``) to its lines."""

    def __init__(self, problems: dict[str, list[str]], where: str) -> None:
        self.problems = problems
        titles = {
            "damaged": "damaged or unreadable",
            "missing": "missing from the source",
            "unexpected": "in the source but not in the map (add them to ignore= to skip them)",
            "shape": "wrong shape",
            "dtype": "wrong dtype (a cast() in the map converts on purpose)",
            "map": "the map and the model disagree",
        }
        count = sum(len(lines) for lines in problems.values())
        text = [f"{count} problem(s) with the weights in {where}; nothing was loaded:"]
        for kind, lines in problems.items():
            text.append(f"  {titles[kind]}:")
            text += [f"    {line}" for line in lines]
        super().__init__("\n".join(text))


@dataclass(frozen=True)
class WeightMap:
    """Which model array is made from which of a file's tensors, and how.

    Args:
      targets: a model state path (``path_str``: ``"h/0/attn/q/kernel"``) -> an
        expression over named tensors (``tensor``, ``split``, ``stack``, ...).
      ignore: regular expressions (full match) of source names that may be there
        and are not read (a causal-mask buffer, a tied head).
      prefixes: prefixes a source may put before every name (``"transformer."``);
        a declared name is looked up as it is, then with each prefix.

    Loading reads it forwards; ``save_safetensors`` reads it backwards: every
    declared tensor is rebuilt from the blocks of the model arrays it feeds.

    >>> from nnx_spmd_trainer.weights import tensor, transpose
    >>> m = WeightMap({"fc/kernel": transpose(tensor("fc.weight", (3, 2)), (1, 0))})
    >>> m.sources()
    {'fc.weight': Tensor(name='fc.weight', shape=(3, 2), dtype=dtype('float32'))}
    """

    targets: Mapping[str, Expr]
    ignore: tuple[str, ...] = ()
    prefixes: tuple[str, ...] = field(default=())

    @classmethod
    def identity(cls, state: object) -> WeightMap:
        """Each array of ``state`` (any tree of shaped leaves: a plan's ``param_targets``, a
        model's ``nnx.State``) from the tensor of its own ``path_str`` name: what reads
        ``export_params``'s checkpoint (``OrbaxSource``) or a ``TreeSource`` of the model.

        >>> import numpy as np
        >>> WeightMap.identity({"fc": {"kernel": np.zeros((3, 2), np.float32)}}).targets
        {'fc/kernel': Tensor(name='fc/kernel', shape=(3, 2), dtype=dtype('float32'))}
        """
        leaves = jax.tree_util.tree_flatten_with_path(state)[0]
        return cls({path_str(p): tensor(path_str(p), x.shape, x.dtype) for p, x in leaves})

    def sources(self) -> dict[str, Tensor]:
        """Every declared source tensor, once (a fused tensor feeds several targets)."""
        found: dict[str, Tensor] = {}
        for path, expr in self.targets.items():
            for leaf in expr.leaves():
                seen = found.setdefault(leaf.name, leaf)
                if (seen.shape, seen.dtype) != (leaf.shape, leaf.dtype):
                    raise ValueError(
                        f"{leaf.name} is declared {seen.shape} {seen.dtype} and, for {path}, "
                        f"{leaf.shape} {leaf.dtype}: declare it once."
                    )
        return found

    def resolve(self, available: Mapping[str, object]) -> dict[str, str]:
        """Each declared name found in ``available`` -> its name there (maybe prefixed)."""
        names = {}
        for name in self.sources():
            for candidate in (name, *(p + name for p in self.prefixes)):
                if candidate in available:
                    names[name] = candidate
                    break
        return names

    def ignored(self, name: str) -> bool:
        return any(re.fullmatch(pattern, name) for pattern in self.ignore)


def check(
    weight_map: WeightMap,
    targets: Mapping[str, jax.ShapeDtypeStruct],
    source: WeightSource | None = None,
) -> dict[str, list[str]]:
    """Everything that keeps ``weight_map`` from filling ``targets`` (path -> shape and
    dtype) from ``source``, by kind; empty when it fits. Without a source, the map
    is checked against the model alone (what an export needs)."""
    problems: dict[str, list[str]] = {}

    def add(kind: str, line: str) -> None:
        problems.setdefault(kind, []).append(line)

    for path, target in targets.items():
        expr = weight_map.targets.get(path)
        if expr is None:
            add(
                "map",
                f"model array {path} {tuple(target.shape)} has no entry in the map (one the "
                "source lacks by design, a LoRA adapter: Pretrained(..., fresh=nnx.LoRAParam))",
            )
        elif (expr.shape, expr.dtype) != (tuple(target.shape), np.dtype(target.dtype)):
            add(
                "map",
                f"{path}: the model has {tuple(target.shape)} {np.dtype(target.dtype)}, "
                f"the map makes {expr.shape} {expr.dtype}",
            )
    for path in sorted(set(weight_map.targets) - set(targets)):
        add("map", f"{path}: in the map, not an array of the model")
    if source is None:
        return problems

    for line in source.problems():
        add("damaged", line)
    available = source.tensors()
    resolved = weight_map.resolve(available)
    for name, declared in sorted(weight_map.sources().items()):
        if name not in resolved:
            add("missing", f"{name} {declared.shape} {declared.dtype}")
            continue
        found = available[resolved[name]]
        if found.shape != declared.shape:
            add("shape", f"{resolved[name]}: {found.shape}, expected {declared.shape}")
        if found.dtype != declared.dtype:
            add("dtype", f"{resolved[name]}: {found.dtype}, expected {declared.dtype}")
    used = set(resolved.values())
    for name in sorted(available):
        if name not in used and not weight_map.ignored(name):
            add("unexpected", f"{name} {available[name].shape} {available[name].dtype}")
    return problems
