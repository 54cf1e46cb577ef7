"""LoopHost: what the ``Loop`` asks of the trainer it runs, and nothing more.

The ``Trainer`` is one; the loop is handed this much of it (the run, the callbacks,
the layout and the user's overrides), so the engine never imports the facade above it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import jax
    from flax import nnx

    from nnx_spmd_trainer.data.placement import Placement
    from nnx_spmd_trainer.engine.hooks import CallbackList
    from nnx_spmd_trainer.engine.run import Run
    from nnx_spmd_trainer.planner.plan import Plan


class LoopHost(Protocol):
    """The trainer as the loop sees it (``Trainer`` is one)."""

    run: Run
    callbacks: CallbackList

    @property
    def plan(self) -> Plan: ...

    @property
    def placement(self) -> Placement: ...

    def train_step(
        self, model: nnx.Module, optimizer: nnx.Optimizer[nnx.Module], batch: Any
    ) -> tuple[jax.Array, dict[str, jax.Array]]: ...

    def eval_fn(self, model: nnx.Module, batch: Any) -> tuple[jax.Array, dict[str, jax.Array]]: ...

    def predict_fn(self, model: nnx.Module, batch: Any) -> Any: ...

    def prepare_batch(self, batch: Any) -> Any: ...
