"""The plan's one cache of compiled steps (``StepCache``), and what each kind of step is
before its strategy compiles it (``step_spec``).

Neither knows the plan: ``Plan.cached_step`` asks the cache, and on a miss builds the
step from ``step_spec`` and compiles it as its strategy says (``Plan.compile_step``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

from flax import nnx

from nnx_spmd_trainer.planner.step import (
    make_eval_step,
    make_predict_step,
    make_train_step,
    over_flat_state,
)


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """A step of the flat state, before it is compiled.

    Attributes:
      fn: ``(state arrays, metrics, batch) -> ...``.
      out_shardings: its outputs' shardings (``None``: as XLA chooses).
      donate_argnums: the arguments whose buffers its outputs may take.
    """

    fn: Callable[..., Any]
    out_shardings: Any
    donate_argnums: tuple[int, ...]


def step_spec(
    kind: str,
    *,
    graphdef: nnx.GraphDef[Any],
    treedef: Any,
    fn: Callable[..., Any],
    wrt: nnx.filterlib.Filter,
    norms: bool,
    skip_nonfinite: bool,
    donate: bool,
    state_shardings: Any,
    replicated: Any,
) -> StepSpec:
    """The ``kind`` step ("train", "eval" or "predict") running ``fn``.

    ``fn`` is the train step ``(model, optimizer, batch) -> (loss, aux)``, the eval
    function ``(model, batch) -> (loss, aux)`` or the predict function ``(model, batch)
    -> outputs``. The train step returns the new state (in ``state_shardings``), the
    metrics, the loss and the norms (replicated), and takes the state's and the metrics'
    buffers when ``donate``; evaluation returns the metrics; prediction its outputs, laid
    out as XLA chooses.
    """
    if kind == "train":
        built = make_train_step(graphdef, fn, wrt=wrt, norms=norms, skip_nonfinite=skip_nonfinite)
        out: Any = (state_shardings, replicated, replicated, replicated)
        donate_argnums: tuple[int, ...] = (0, 1) if donate else ()
    elif kind == "eval":
        built, out, donate_argnums = make_eval_step(graphdef, fn), replicated, ()
    elif kind == "predict":
        built, out, donate_argnums = make_predict_step(graphdef, fn), None, ()
    else:
        raise ValueError(f"kind must be 'train', 'eval' or 'predict', got {kind!r}.")
    flat = over_flat_state(built, treedef, returns_state=kind == "train")
    return StepSpec(flat, out, donate_argnums)


class CachedStep(NamedTuple):
    """A compiled step from the cache, and whether this lookup compiled it (``new``: its
    first call traces and compiles, dispatch being asynchronous)."""

    fn: Callable[..., Any]
    new: bool


class StepCache:
    """Compiled steps, each compiled once per key (``Plan.cached_step``'s: the kind, the
    norms variant, the graph, the batch's structure, the function and what it reads at
    trace time).

    It needs shapes, not arrays, so a step can be lowered before any array of the state
    exists (``Plan.lower``). Asked once per train step: a graph (``nnx.GraphDef``) hashes
    in milliseconds for a large model (3.7 ms for a 12-layer GPT, measured on the CPU),
    so the graph is keyed by an id (``graph_id``), found by identity for the object seen
    last (the live model's, the same object for a whole ``fit``).
    """

    def __init__(self) -> None:
        self._compiled: dict[Hashable, Callable[..., Any]] = {}
        self._graph_ids: dict[nnx.GraphDef[Any], int] = {}
        self._last_graph: tuple[nnx.GraphDef[Any], int] | None = None

    @property
    def count(self) -> int:
        """How many steps were compiled."""
        return len(self._compiled)

    def graph_id(self, graphdef: nnx.GraphDef[Any]) -> int:
        """A small int standing for ``graphdef``: equal graphs get the same one."""
        last = self._last_graph
        if last is not None and last[0] is graphdef:
            return last[1]
        found = self._graph_ids.setdefault(graphdef, len(self._graph_ids))
        self._last_graph = (graphdef, found)
        return found

    def put(self, key: Hashable, step: Callable[..., Any]) -> None:
        """Keeps ``step`` as ``key``'s, compiled elsewhere (a saved step loaded)."""
        self._compiled[key] = step

    def get(self, key: Hashable, build: Callable[[], Callable[..., Any]]) -> CachedStep:
        """The step compiled for ``key``, compiled by ``build()`` the first time."""
        compiled = self._compiled.get(key)
        if compiled is not None:
            return CachedStep(compiled, new=False)
        compiled = self._compiled[key] = build()
        return CachedStep(compiled, new=True)
