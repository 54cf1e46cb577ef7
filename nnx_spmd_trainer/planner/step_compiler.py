"""StepCompiler: the plan's cache of compiled train, eval and predict steps."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
from flax import nnx

from nnx_spmd_trainer.planner.step import (
    Batch,
    make_eval_step,
    make_predict_step,
    make_train_step,
    over_flat_state,
)

if TYPE_CHECKING:
    from nnx_spmd_trainer.planner.plan import Plan


class StepCompiler:
    """Compiles the train and eval steps once per kind, batch structure and variant.

    It needs shapes, not arrays: the state's layout comes from the plan's
    abstract state, so a step can be lowered before any array of the state
    exists (``Plan.lower``). The plan compiles each step as its strategy says
    (``Plan.compile_step``: how to wrap, trace and jit it).
    """

    def __init__(self, plan: Plan, *, donate: bool = True, skip_nonfinite: bool = False) -> None:
        self.plan = plan
        self.donate = donate  # the train step's state and metrics buffers, to its outputs
        self.skip_nonfinite = skip_nonfinite  # make_train_step's
        self._compiled: dict[Any, Callable[..., Any]] = {}

    @property
    def count(self) -> int:
        """How many steps were compiled (a new one traces and compiles in its first call)."""
        return len(self._compiled)

    def get(
        self,
        kind: str,
        batch: Batch,
        *,
        graphdef: nnx.GraphDef[Any],
        treedef: Any,
        fn: Callable[..., Any],
        wrt: nnx.filterlib.Filter = nnx.Param,
        norms: bool = False,
        key: Any = (),
    ) -> Callable[..., Any]:
        """The jitted ``kind`` step ("train", "eval" or "predict") for batches like ``batch``.

        ``fn`` is the train step ``(model, optimizer, batch) -> (loss, aux)``, the
        eval function ``(model, batch) -> (loss, aux)`` or the predict function
        ``(model, batch) -> outputs`` (laid out as XLA chooses); ``key`` tells apart
        settings ``fn`` reads at trace time (gradient accumulation).
        """
        cache_key = (kind, norms, graphdef, jax.tree.structure(batch), fn, key)
        if cache_key in self._compiled:
            return self._compiled[cache_key]
        replicated = self.plan.replicated
        if kind == "train":
            built = make_train_step(
                graphdef, fn, wrt=wrt, norms=norms, skip_nonfinite=self.skip_nonfinite
            )
            out: Any = (self.plan.leaf_shardings, replicated, replicated, replicated)
            donate: tuple[int, ...] = (0, 1) if self.donate else ()
        elif kind == "eval":
            built = make_eval_step(graphdef, fn)
            out, donate = replicated, ()
        else:
            built, out, donate = make_predict_step(graphdef, fn), None, ()
        flat = over_flat_state(built, treedef, returns_state=kind == "train")
        compiled = self.plan.compile_step(
            flat, batch=batch, out_shardings=out, donate_argnums=donate
        )
        self._compiled[cache_key] = compiled
        return compiled
