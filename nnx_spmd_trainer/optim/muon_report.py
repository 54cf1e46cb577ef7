"""The optimizer's own program: one update compiled alone, so its collectives are seen
apart from the model's.

In the train step the optimizer's collectives are mixed with the forward and backward
passes' (FSDP's own all-gathers of every weight). ``optimizer_update`` compiles just
``optimizer.update(model, grads)`` with the plan's layout (state and gradients laid out
as the plan lays out the state, traced inside the plan's ``trace_context``, so a Muon
from ``optim.muon`` finds its matrices' owners), from shapes alone; its HLO's
collectives are the optimizer's per step (``planner.plan_report.collectives`` counts
them). The plan is taken as it is (any ``Plan``: this room sits below the planner).
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx


def optimizer_update(plan: Any) -> jax.stages.Compiled:
    """``optimizer.update(model, grads)`` of ``plan``'s state, compiled alone with the
    plan's shardings (gradients laid out as their parameters); no array is built."""
    targets = plan.state_targets()
    grads = nnx.state(
        nnx.merge(plan.graphdef, nnx.State(jax.tree.map(lambda x: x, targets)))["model"],
        plan.wrt,
    )
    grad_shardings = jax.tree.map(lambda x: x.sharding, jax.tree.leaves(grads))
    grad_treedef = jax.tree.structure(grads)

    def update(state_leaves: list[Any], grad_leaves: list[Any]) -> list[Any]:
        objects = nnx.merge(plan.graphdef, jax.tree.unflatten(plan.treedef, state_leaves))
        objects["optimizer"].update(objects["model"], jax.tree.unflatten(grad_treedef, grad_leaves))
        return jax.tree.leaves(nnx.state(objects))

    def traced(state_leaves: list[Any], grad_leaves: list[Any]) -> list[Any]:
        with plan.trace_context():
            return update(state_leaves, grad_leaves)

    jitted = jax.jit(
        traced,
        in_shardings=(plan.leaf_shardings, grad_shardings),
        out_shardings=plan.leaf_shardings,
        donate_argnums=(0,),
    )
    with jax.set_mesh(plan.mesh):
        return jitted.lower(jax.tree.leaves(targets), jax.tree.leaves(grads)).compile()
