"""Run state: everything a resumed run needs, as a value.

The ``Run`` (run.py) owns the run; ``Trainer.run_state()`` is its snapshot as a
``RunState``, and ``Trainer.load_run_state(...)`` puts one back. A checkpoint
callback maps it to storage and decides when: it never reads or writes the
trainer's progress field by field.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np

#: The key of the JSON stand-in for an array leaf of a callback's state in ``RunState.host()``.
ARRAY_MARK = "__nnx_spmd_trainer.array__"
_PLAIN = (type(None), bool, int, float, str)


def _where(path: tuple[Any, ...]) -> str:
    return "state_dict()" + "".join(f"[{p!r}]" for p in path)


def _refuse(key: str, path: tuple[Any, ...], what: str) -> TypeError:
    return TypeError(
        f"The state_dict() of callback {key!r} holds {what} at {_where(path)}, which a "
        "checkpoint cannot store. A callback's state may hold arrays (jax.Array, NumPy) and "
        "plain values: None, bool, int, float, str, and lists, tuples and str-keyed dicts of "
        "them (see Callback.state_dict)."
    )


def _split_state(key: str, state: Any) -> tuple[Any, dict[str, Any]]:
    """One callback's state as (JSON with array stand-ins, ``{"0": array, ...}``).

    Raises ``TypeError`` naming the callback and the key path of the first value that is
    neither an array nor plain JSON: refused here, before anything is written.
    """
    arrays: dict[str, Any] = {}

    def walk(x: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(x, jax.ShapeDtypeStruct):
            raise _refuse(key, path, "a jax.ShapeDtypeStruct (a layout for a restore, not a value)")
        if isinstance(x, jax.Array | np.ndarray | np.generic):
            index = str(len(arrays))
            arrays[index] = x
            kind = "jax" if isinstance(x, jax.Array) else "scalar" if np.isscalar(x) else "numpy"
            return {ARRAY_MARK: index, "kind": kind}
        if isinstance(x, _PLAIN):
            return x
        if isinstance(x, Mapping):
            out = {}
            for k, v in x.items():
                if not isinstance(k, str):
                    raise _refuse(key, (*path, k), f"a dict key of type {type(k).__name__}")
                out[k] = walk(v, (*path, k))
            return out
        if isinstance(x, list | tuple):
            if all(type(v) in _PLAIN for v in x):  # the common case (History): no recursion
                return list(x)
            return [walk(v, (*path, i)) for i, v in enumerate(x)]
        raise _refuse(key, path, f"a {type(x).__module__}.{type(x).__qualname__}")

    return walk(state, ()), arrays


def array_marks(state: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], dict]]:
    """``(key path, stand-in)`` for every array stand-in in a callback's saved JSON state."""
    if isinstance(state, dict):
        if ARRAY_MARK in state:
            yield path, state
            return
        for k, v in state.items():
            yield from array_marks(v, (*path, k))
    elif isinstance(state, list):
        for i, v in enumerate(state):
            yield from array_marks(v, (*path, i))


def _join_state(state: Any, arrays: Mapping[str, Any]) -> Any:
    if isinstance(state, dict):
        if ARRAY_MARK in state:
            value = arrays[state[ARRAY_MARK]]
            if state.get("kind") == "numpy":
                return np.asarray(value)
            if state.get("kind") == "scalar":
                return np.asarray(value)[()]
            return value
        return {k: _join_state(v, arrays) for k, v in state.items()}
    if isinstance(state, list):
        return [_join_state(v, arrays) for v in state]
    return state


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
      callbacks: every stateful callback's ``state_dict()`` by its ``state_key``: plain
        values and arrays (``Callback.state_dict``). ``host()`` holds their plain part,
        with a stand-in for each array (``array_stand_ins`` lists them), and
        ``callback_arrays()`` the arrays.
      data: where the next batch starts: the epoch iterator's ``get_state()``
        value (a Grain iterator's dict, a ``DataLoader``'s bytes), ``data.BATCHES_TAKEN``
        (a Grain position saved under another process count: a per-process input pipeline
        is set from ``batches_in_epoch``), or ``None`` when the data has no position
        (a resumed run then skips batches).

    Example (a checkpoint in plain Orbax; ``RunState.host`` is JSON; a callback state
    holding arrays would add one ``StandardSave`` item per ``callback_arrays()`` key)::

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

    @functools.cached_property
    def _callbacks_split(self) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
        host, arrays = {}, {}
        for key, state in self.callbacks.items():
            host[key], leaves = _split_state(key, state)
            if leaves:
                arrays[key] = leaves
        return host, arrays

    def host(self) -> dict[str, Any]:
        """The host part as JSON-able values (``data`` included when it is JSON).

        Each array in a callback's state is replaced by a stand-in naming its entry in
        ``callback_arrays()``. A callback state holding anything else that is not
        JSON (a set, an object) raises ``TypeError`` naming the callback and the key.
        """
        host = {
            field.name: getattr(self, field.name)
            for field in dataclasses.fields(self)
            if field.name not in ("state", "train_metrics")
        }
        host["callbacks"] = self._callbacks_split[0]
        if isinstance(self.data, bytes):
            del host["data"]  # a DataLoader's position: save it with Grain's own handler
        return host

    def callback_arrays(self) -> dict[str, dict[str, Any]]:
        """The arrays of the callback states: ``{state_key: {"0": array, ...}}``, only for
        callbacks that hold arrays (the numbering is that of ``host()``'s stand-ins)."""
        return self._callbacks_split[1]

    @staticmethod
    def array_stand_ins(saved: Any) -> Iterator[tuple[tuple[Any, ...], str, str | None]]:
        """``(key path, index, kind)`` for each array stand-in in one callback's state as
        ``host()["callbacks"]`` holds it, so a restore can build a target for each array
        before reading it: the array is that callback's ``callback_arrays()[index]``;
        ``kind`` is ``"jax"`` for a ``jax.Array``, ``"numpy"`` or ``"scalar"`` for NumPy.

        >>> run = RunState(None, None, 0, 0, 0, 0, {"ema": {"w": np.zeros(2)}})
        >>> list(RunState.array_stand_ins(run.host()["callbacks"]["ema"]))
        [(('w',), '0', 'numpy')]
        """
        for path, mark in array_marks(saved):
            yield path, mark[ARRAY_MARK], mark.get("kind")

    @classmethod
    def from_saved(
        cls,
        arrays: Mapping[str, Any],
        host: Mapping[str, Any],
        *,
        callback_arrays: Mapping[str, Mapping[str, Any]] | None = None,
        **overrides: Any,
    ) -> RunState:
        """The inverse of ``arrays()``, ``host()`` and ``callback_arrays()`` (``overrides``:
        e.g. ``data=``).

        A callback whose saved state holds arrays gets its state back only when
        ``callback_arrays`` holds its key (a restore may leave out the arrays of
        callbacks the trainer does not have); without ``callback_arrays`` at all, such a
        state is an error rather than a state silently dropped.
        """
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in host.items() if k in fields}
        callbacks = {}
        for key, state in dict(values.get("callbacks") or {}).items():
            if next(array_marks(state), None) is None:
                callbacks[key] = state
            elif callback_arrays is None:
                raise ValueError(
                    f"the saved state of callback {key!r} holds arrays: pass them as "
                    "from_saved(..., callback_arrays={state_key: {index: array}})."
                )
            elif key in callback_arrays:
                callbacks[key] = _join_state(state, callback_arrays[key])
        values["callbacks"] = callbacks
        return cls(**{**values, **arrays, **overrides})


class Progress:
    """Where the running (or last) ``fit`` is. The ``Run`` holds it, the loop writes it,
    callbacks read it.

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
        # While an epoch prefetches batches ahead of its iterator: where the next step's starts.
        self._ahead: Callable[[], Any] | None = None

    def position(self) -> Any:
        """The position of the next training batch, for ``grain.checkpoint.CheckpointSave``:
        the Grain iterator itself, or, while batches are prefetched ahead of it, a
        ``Position`` recorded after the last batch a step took."""
        return self._ahead() if self._ahead is not None else self.train_iterator

    def read_ahead(self, position: Callable[[], Any] | None) -> None:
        """The running epoch's position of the next step's batch while its batches are
        read ahead (``Prefetch.position``); ``None`` when the epoch's loop has ended."""
        self._ahead = position
