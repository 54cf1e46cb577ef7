"""Forward-only programs of a plan: ``fn(model, batch)`` over a model's state and a
placed batch, compiled for the plan's layout and kept in the plan's one cache of
compiled programs (``Plan.steps``), as the train and eval steps are.

A reference model's log-probabilities (DPO, GRPO), lm-eval's scoring and any other
pass that reads a model without differentiating it go through ``Plan.forward_program``:
one compiled program per function, graph, state layout and batch shapes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from nnx_spmd_trainer.data.batches import batch_kind

__all__ = ["AS_COMPILED", "ForwardFn", "abstract", "forward_program"]

#: ``out_shardings=AS_COMPILED``: the outputs laid out as the compiler chooses (a
#: ``predict_fn``'s outputs need not have rows).
AS_COMPILED = "as compiled"

#: ``(model, batch) -> outputs``: a forward pass, traced with the model merged in eval mode.
ForwardFn = Callable[[nnx.Module, Any], Any]


def abstract(tree: Any) -> Any:
    """``tree``'s leaves as ``jax.ShapeDtypeStruct`` s (arrays, numpy arrays or shapes),
    each keeping its sharding where it has one."""

    def leaf(x: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

    return jax.tree.map(leaf, tree)


def forward_program(
    plan: Any,  # a Plan (this module is the plan's: not imported back)
    fn: ForwardFn,
    graphdef: nnx.GraphDef[Any],
    state: Any,
    batch: Any,
    *,
    enter: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    out_shardings: Any = None,
) -> Callable[[Any, Any], Any]:
    """``program(state, batch) -> fn(model, batch)``, compiled once per ``fn``, graph,
    state layout and batch shapes, and kept in ``plan.steps``.

    Inside the program the model is ``nnx.merge(graphdef, state)`` in eval mode (no
    dropout; the live model's mode is the caller's), traced within the plan's
    ``trace_context`` and ``enter()`` when given (``nn.lora.adapters_off``: a LoRA
    policy's base). ``state`` is read for its shardings (arrays, or
    ``jax.ShapeDtypeStruct`` s with shardings: a program lowered before any array exists),
    ``batch`` for its shapes. The outputs are laid out as the plan lays out a batch's
    rows (``plan.batch_shardings`` of their shapes) unless ``out_shardings`` says
    (``AS_COMPILED``: as the compiler chooses).
    """
    batch_shapes = abstract(batch)
    state_leaves, state_def = jax.tree.flatten(state)
    state_shardings = tuple(leaf.sharding for leaf in state_leaves)
    key = (
        "forward",
        fn,
        plan.steps.graph_id(graphdef),
        enter,
        state_def,
        state_shardings,
        batch_kind(batch_shapes),
    )

    def build() -> Callable[..., Any]:
        batch_shardings = plan.batch_shardings(batch_shapes)

        def program(state: Any, batch: Any) -> Any:
            with plan.trace_context(batch_shardings), (enter or contextlib.nullcontext)():
                model = nnx.merge(graphdef, state)
                model.eval()
                return fn(model, batch)

        outs = None if out_shardings is AS_COMPILED else out_shardings
        if out_shardings is None:
            with jax.set_mesh(plan.mesh):
                shapes = jax.eval_shape(program, abstract(state), batch_shapes)
            outs = plan.batch_shardings(shapes)
        return plan.compile_program(
            program,
            in_shardings=(jax.tree.unflatten(state_def, state_shardings), batch_shardings),
            out_shardings=outs,
        )

    return plan.steps.get(key, build).fn
