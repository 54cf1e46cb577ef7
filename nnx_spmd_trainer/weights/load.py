"""Pretrained weights into a plan's layout: each device given only its own blocks.

``load_weights`` checks the map, the model and the source first and raises one
``WeightsMismatch`` listing every problem; then it builds one array at a time
with ``jax.make_array_from_callback``, whose callback reads just the block one
device holds (through the memory-mapped file and the map's transforms). Each
device receives only its own blocks, never a whole array it shards; the host
holds the blocks of one array for its transfer (at most that array, the
process's devices' part of it), read from the file's mapped pages.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

import jax
from flax import nnx

from nnx_spmd_trainer.sharding import path_str
from nnx_spmd_trainer.weights.expr import Expr, normalize_index
from nnx_spmd_trainer.weights.mapping import WeightMap, WeightsMismatch, check
from nnx_spmd_trainer.weights.sources import SafetensorsSource, WeightSource

if TYPE_CHECKING:
    from nnx_spmd_trainer.planner.plan import Plan

__all__ = ["Pretrained", "load_weights", "param_targets", "pretrained_state"]


def param_targets(plan: Plan, fresh: nnx.filterlib.Filter = nnx.Nothing) -> nnx.State:
    """The model's ``nnx.Param`` leaves as ``jax.ShapeDtypeStruct`` s with the plan's
    shardings: what ``load_weights`` fills. Those ``fresh`` names (an ``nnx`` filter:
    ``nnx.LoRAParam``) are left out: the model's initializer makes them."""
    wanted = nnx.All(nnx.Param, nnx.Not(fresh))
    return nnx.filter_state(plan.state_targets()["model"], wanted)


def _as_source(source: WeightSource | str | os.PathLike[str]) -> WeightSource:
    return SafetensorsSource(source) if isinstance(source, str | os.PathLike) else source


def load_weights(
    target: Plan | nnx.State,
    source: WeightSource | str | os.PathLike[str],
    weight_map: WeightMap,
) -> nnx.State:
    """The model's parameters read from ``source`` through ``weight_map``, laid out as
    ``target`` says.

    Args:
      target: a ``Plan`` (its model's ``nnx.Param`` leaves, ``param_targets(plan)``),
        or any state of ``jax.ShapeDtypeStruct`` s carrying shardings.
      source: a ``WeightSource``, or a path to a ``.safetensors`` file or a directory
        of them (``SafetensorsSource``).
      weight_map: model path -> expression over the source's tensors.

    Returns:
      ``target``'s structure holding ``jax.Array`` s, every one with its target's sharding.

    Raises:
      WeightsMismatch: every missing, unexpected, mis-shaped, mistyped or damaged
        tensor, and every model array the map does not make, at once, before any
        array is built.
    """
    targets = param_targets(target) if not isinstance(target, nnx.State) else target
    source = _as_source(source)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(targets)
    by_path = {path_str(p): leaf for p, leaf in leaves}
    _raise_problems(weight_map, by_path, source)
    resolved = weight_map.resolve(source.tensors())
    tensors = _Renamed(source, resolved)
    arrays = [_build(weight_map.targets[path], leaf, tensors) for path, leaf in by_path.items()]
    return jax.tree.unflatten(treedef, arrays)


def _raise_problems(weight_map: WeightMap, by_path: dict[str, Any], source: WeightSource) -> None:
    """``WeightsMismatch`` naming every problem of ``source`` for the targets ``by_path``."""
    problems = check(weight_map, by_path, source)
    if problems:
        raise WeightsMismatch(problems, where=repr(source))


class _Renamed:
    """The source's tensors under the map's names (a ``transformer.`` prefix dropped)."""

    def __init__(self, source: WeightSource, names: dict[str, str]) -> None:
        self.source, self.names = source, names

    def __getitem__(self, name: str) -> Any:
        return self.source[self.names[name]]


def _build(expr: Expr, target: jax.ShapeDtypeStruct, tensors: Any) -> jax.Array:
    shape = tuple(target.shape)
    blocks: dict[Any, Any] = {}  # replicated devices ask for the same block: read it once

    def block(index: tuple[slice, ...]) -> Any:
        key = normalize_index(index, shape)
        bounds = tuple((s.start, s.stop) for s in key)
        if bounds not in blocks:
            blocks[bounds] = expr.read(key, tensors)
        return blocks[bounds]

    sharding = target.sharding
    if sharding is None:
        raise ValueError(f"the target {target} carries no sharding")
    return jax.make_array_from_callback(shape, sharding, block)  # type: ignore[arg-type]


def pretrained_state(plan: Plan, params: nnx.State) -> nnx.State:
    """The plan's whole initial state (``{"model", "optimizer"}``) with ``params`` as the
    model's parameters (``Plan.materialize(params)``): the optimizer's state made from
    them, every other variable (RNG streams, ...) as the plan's initialiser makes it;
    the random parameters are never built. ``params`` is donated: do not use it after.
    """
    return plan.materialize(params)


@dataclasses.dataclass(frozen=True)
class Pretrained:
    """Where a trainer's first state comes from: ``source`` read through ``weight_map``
    (``Trainer(init_from=Pretrained(path, weight_map))``).

    The state is built from it when first needed, instead of the plan's random
    initialiser: a run resumed from its own checkpoints at the start of ``fit``
    restores those and never reads it.

    ``fresh`` (an ``nnx`` filter, default none) names the parameters the source does
    not have by design, which the model's initializer makes as it would without a
    source: a new head. A plan's LoRA adapters are always left out (``fresh_in``). The
    map leaves them out; every other parameter must still come from the source.
    ``weight_map=None``: the file holds each parameter under its own path
    (``"h/0/attn/q/kernel"``), as ``save_safetensors(model, path, WeightMap.identity(
    nnx.state(model, nnx.Param)))`` writes it.
    """

    source: WeightSource | str | os.PathLike[str]
    weight_map: WeightMap | None
    fresh: nnx.filterlib.Filter = nnx.Nothing

    def fresh_in(self, plan: Plan) -> nnx.filterlib.Filter:
        """``fresh``, and the plan's LoRA adapters where it adds some (``Plan(lora=...)``):
        a base's file holds none, and the adapters are the plan's initializer's. The
        plan, not a copy of this object, says so: every reader (``check``, ``state``, a
        job's check before training) leaves out the same leaves."""
        if getattr(plan, "lora", None) is None:
            return self.fresh
        return nnx.Any(self.fresh, nnx.LoRAParam)

    def map_for(self, targets: nnx.State) -> WeightMap:
        """``weight_map``, or, where it is ``None``, each parameter read from the tensor of
        its own path (``WeightMap.identity``: a file written under the model's own names,
        as ``--export_format=merged`` writes a model without a map)."""
        return self.weight_map if self.weight_map is not None else WeightMap.identity(targets)

    def check(self, plan: Plan) -> None:
        """Raises the ``WeightsMismatch`` that ``state`` would (a damaged or truncated file,
        another model's names or shapes), from the source's headers: no array is built."""
        targets = param_targets(plan, self.fresh_in(plan))
        by_path = {
            path_str(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(targets)[0]
        }
        _raise_problems(self.map_for(targets), by_path, _as_source(self.source))

    def state(self, plan: Plan) -> nnx.State:
        """The plan's whole initial state, with the parameters from the source."""
        targets = param_targets(plan, self.fresh_in(plan))
        params = load_weights(targets, self.source, self.map_for(targets))
        return pretrained_state(plan, params)
