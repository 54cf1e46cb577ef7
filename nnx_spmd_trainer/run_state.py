"""Run state: everything a resumed run needs, owned by the core.

``Trainer.run_state()`` builds a ``RunState``; ``Trainer.load_run_state(...)``
puts one back. A checkpoint callback maps it to storage and decides when:
it never reads or writes the trainer's progress field by field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

from nnx_spmd_trainer.data import DataPosition
from nnx_spmd_trainer.prefetch import Prefetch


@dataclasses.dataclass(frozen=True)
class RunState:
    """One training run at a step: device arrays, and host values that are JSON.

    Attributes:
      state: ``{"model", "optimizer"}`` as an ``nnx.State`` (the optimizer's count
        is the step), or its ``jax.ShapeDtypeStruct`` targets when abstract.
      train_metrics: the on-device metric accumulators since the last log point.
      step: the global step (informative: the state's optimizer count is the truth).
      epoch: the epoch the run is in, and ``batches_in_epoch`` the batches of it taken.
      train_metric_steps: the steps ``train_metrics`` hold.
      callbacks: every stateful callback's ``state_dict()`` by its ``state_key``.
      data: where the next batch starts: the epoch iterator's ``get_state()``
        value (a Grain iterator's dict, a ``DataLoader``'s bytes), or ``None``
        when the data has no position (a resumed run then skips batches).

    Example (a checkpoint in plain Orbax; ``RunState.host`` is JSON)::

        run = trainer.run_state()
        manager.save(step, args=ocp.args.Composite(
            arrays=ocp.args.StandardSave(run.arrays()), host=ocp.args.JsonSave(run.host())))
        ...
        target = trainer.run_state(abstract=True)
        saved = manager.restore(step, args=ocp.args.Composite(
            arrays=ocp.args.StandardRestore(target.arrays()), host=ocp.args.JsonRestore()))
        trainer.load_run_state(RunState.from_saved(saved["arrays"], saved["host"]))
    """

    state: Any
    train_metrics: Any
    step: int
    epoch: int
    batches_in_epoch: int
    train_metric_steps: int
    callbacks: Mapping[str, Any]
    data: Any = None

    def arrays(self) -> dict[str, Any]:
        """The device part: ``{"state": ..., "train_metrics": ...}``."""
        return {"state": self.state, "train_metrics": self.train_metrics}

    def host(self) -> dict[str, Any]:
        """The host part as JSON-able values (``data`` included when it is JSON)."""
        host = dataclasses.asdict(self)
        del host["state"], host["train_metrics"]
        if isinstance(self.data, bytes):
            del host["data"]  # a DataLoader's position: save it with Grain's own handler
        return host

    @classmethod
    def from_saved(
        cls, arrays: Mapping[str, Any], host: Mapping[str, Any], **overrides: Any
    ) -> RunState:
        """The inverse of ``arrays()`` and ``host()`` (``overrides``: e.g. ``data=``)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in host.items() if k in fields}
        return cls(**{**values, **arrays, **overrides})


class Progress:
    """Where the running (or last) ``fit`` is. The trainer writes it; callbacks read it.

    Attributes:
      epoch: the epoch, counted from 0 in each ``fit`` (or from where a resumed run stopped).
      batches_in_epoch: batches taken from ``train_iterator`` in this epoch.
      train_iterator: the iterator of the running (or last) epoch (a Grain
        ``DatasetIterator`` has ``get_state()``); ``None`` before the first. While
        the epoch runs it is read ahead by the prefetch: ``position()`` is where
        the next step's batch starts.
      max_steps, eval_every_n_steps: the running ``fit``'s arguments.
      preempted: the run stopped for a preemption (``Trainer.request_stop``).
      nonfinite_step: the first step whose loss was not finite, as a callback
        reported it (``Trainer.request_stop``); no checkpoint saves from there on.
    """

    def __init__(self) -> None:
        self.epoch = 0
        self.batches_in_epoch = 0
        self.train_iterator: Iterator[Any] | None = None
        self.max_steps: int | None = None
        self.eval_every_n_steps: int | None = None
        self.preempted = False
        self.nonfinite_step: int | None = None
        self.resume_at: DataPosition | None = None  # the next fit's first epoch and batch
        self.batches: Prefetch | None = None  # the running epoch's batches

    def position(self) -> Any:
        """The position of the next training batch, for ``grain.checkpoint.CheckpointSave``:
        the Grain iterator itself, or, while batches are prefetched ahead of it, a
        ``Position`` recorded after the last batch a step took."""
        return self.batches.position() if self.batches else self.train_iterator
