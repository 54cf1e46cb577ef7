"""StepRecord: what one training step hands the hooks (Levanter's ``StepInfo``).

The loop makes one after each step, hands it to every callback as ``self.step_record``
before the step's ``on_train_batch_end`` (``CallbackList.hand_record``) and keeps the
last as ``trainer.last_step``. Nothing in it costs a device sync: the loss stays on the
devices until a hook asks for its value (``loss_value``), and it holds the batch's shapes,
not the batch (a callback that needs the batch asks for it: ``Callback.needs_batch``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One finished training step (``callback.step_record``, ``trainer.last_step``; frozen).

    Attributes:
      step: the global step after it (the optimizer's update count).
      loss: its loss, a scalar still on the devices (keeping it costs nothing;
        reading it waits for the step: ``loss_value``).
      batch_shapes: its global batch as ``jax.ShapeDtypeStruct`` s (shape, dtype,
        sharding): what a hook needs to count examples and tokens or to ask
        ``trainer.plan.report(record.batch_shapes)``, without holding the batch.
      data_wait_s: host seconds waiting for its batch.
      compile_s: host seconds tracing and compiling its step (0 but on a new step).
      step_s: host seconds dispatching it, with the waits of the in-flight bound.
    """

    step: int
    loss: jax.Array
    batch_shapes: Any
    data_wait_s: float = 0.0
    compile_s: float = 0.0
    step_s: float = 0.0

    def loss_value(self) -> float:
        """The loss as a host float: waits for the step to finish on the devices.

        The loss is replicated: this process's first copy is the global value."""
        return float(np.asarray(self.loss.addressable_data(0)))


def batch_shapes(batch: Any, known: Any = None) -> Any:
    """``batch`` (global arrays) as ``jax.ShapeDtypeStruct`` s, with their shardings.

    ``known``: an earlier batch's shapes, returned as they are when ``batch`` has the same
    (most steps: comparing costs a few microseconds, making new ones about ten per leaf).
    """
    leaves, treedef = jax.tree.flatten(batch)
    treedef = cast(Any, treedef)  # jaxlib's stub names PyTreeDef in a way mypy cannot resolve
    if known is not None:
        known_leaves, known_treedef = jax.tree.flatten(known)
        if known_treedef == treedef and all(
            (x.shape, x.dtype, getattr(x, "sharding", None)) == (k.shape, k.dtype, k.sharding)
            for x, k in zip(leaves, known_leaves, strict=True)
        ):
            return known
    return treedef.unflatten(
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
        for x in leaves
    )
