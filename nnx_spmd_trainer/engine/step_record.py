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


class BatchShapes:
    """Each step's global batch as ``jax.ShapeDtypeStruct`` s (``StepRecord.batch_shapes``),
    made again only when the batches' structure, shapes, dtypes or shardings change.

    Asked every step: a step like the last costs one flatten and one comparison of
    what it read (attributes of the same objects, compared by identity first), and
    returns the last step's shapes, the same object (``shapes is last``: the loop
    reads what it derives from them, the tokens, only when they change).
    """

    def __init__(self) -> None:
        self._seen: tuple[Any, ...] | None = None
        self._shapes: Any = None

    def of(self, batch: Any) -> Any:
        leaves, treedef = jax.tree.flatten(batch)
        seen = (treedef, *[(x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves])
        if seen != self._seen:
            self._seen = seen
            self._shapes = cast(
                Any, treedef
            ).unflatten(  # jaxlib's stub: PyTreeDef unnamed
                jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
                for shape, dtype, sharding in seen[1:]
            )
        return self._shapes
