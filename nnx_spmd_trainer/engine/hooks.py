"""The hooks the engine calls: their no-op base, the list that dispatches them, History.

The user's ``Callback`` (``nnx_spmd_trainer.callback``) is ``BaseCallback`` with
``self.trainer`` typed as the real ``Trainer``; concrete callbacks live in
``nnx_spmd_trainer.callbacks``.

Why two classes: the engine calls hooks on a trainer it must not import (the trainer sits
above the engine; an import, even under ``TYPE_CHECKING``, would close a circle). So here
the trainer a callback is handed is a type parameter (``BaseCallback[TrainerT]``) and the
dispatch asks of it only a ``HookHost`` (its step and its run's timings); the
``Trainer`` (``trainer.py``) builds the list from ``BaseCallback`` objects, and the public
``Callback`` binds the parameter to ``Trainer`` one layer above ``trainer.py``. Nothing
here knows the facade; nothing circles.

How the logs flow through the hooks: ``nnx_spmd_trainer.callback``.
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Generic, Protocol, TypeVar

from nnx_spmd_trainer.engine.step_record import StepRecord

Logs = dict[str, float]

#: The trainer a callback is handed: ``Trainer`` for the public ``Callback``.
TrainerT = TypeVar("TrainerT")


class _Timings(Protocol):
    def timing(self, what: str) -> AbstractContextManager[None]: ...


class _TimedRun(Protocol):
    @property
    def timings(self) -> _Timings: ...


class HookHost(Protocol):
    """The trainer as the dispatch sees it (``Trainer`` is one): the global step the
    finished logs belong to, and the run's timings the hooks' time counts in."""

    @property
    def step(self) -> int: ...

    @property
    def run(self) -> _TimedRun: ...


class BaseCallback(Generic[TrainerT]):
    """Every hook, a no-op until overridden, handed a trainer of type ``TrainerT``.

    Write callbacks as ``nnx_spmd_trainer.Callback`` (this class with ``TrainerT`` the
    ``Trainer``: its docstring tells the hooks); the engine's own ``History`` is a
    ``BaseCallback[Any]``. ``order``, ``goodput``, ``state_key``, ``step_record`` and
    ``needs_batch``: see ``Callback``.
    """

    order: int = 0
    goodput: str = "callbacks"
    #: The last training step, handed before its ``on_train_batch_end`` (``hand_record``).
    step_record: StepRecord | None = None
    #: ``True``: the placed batch of that step is handed too, as ``step_batch``.
    needs_batch: bool = False
    step_batch: Any = None
    trainer: TrainerT
    _state_key: str | None = None

    def set_trainer(self, trainer: TrainerT) -> None:
        self.trainer = trainer

    def on_fit_start(self, logs: Logs) -> None:
        """First in ``fit``, before ``on_train_begin``: restore a checkpoint here.

        The state, ``trainer.step`` and callback states it leaves are what
        every ``on_train_begin`` sees.
        """

    def on_train_begin(self, logs: Logs) -> None: ...
    def on_train_end(self, logs: Logs) -> None: ...

    def on_fit_end(self, logs: Logs) -> None:
        """Last in a ``fit`` that did not fail, after ``on_train_end`` and its ``on_logs``:
        every callback has seen every value. Save a final checkpoint, close files here."""

    def on_epoch_begin(self, epoch: int, logs: Logs) -> None: ...
    def on_epoch_end(self, epoch: int, logs: Logs) -> None: ...
    def on_train_batch_begin(self, step: int, logs: Logs) -> None: ...
    def on_train_batch_end(self, step: int, logs: Logs) -> None: ...

    def on_step_end(self, step: int) -> None:
        """After step ``step`` is done and reported: its hooks, its ``on_logs`` and the
        evaluation due at it, if any. A checkpoint saved here holds all of it."""

    def on_test_begin(self, logs: Logs) -> None: ...
    def on_test_end(self, logs: Logs) -> None: ...
    def on_test_batch_begin(self, step: int, logs: Logs) -> None: ...
    def on_test_batch_end(self, step: int, logs: Logs) -> None: ...

    def on_logs(self, step: int, logs: Logs) -> None:
        """The finished ``logs`` of a log point, at the global ``step``: all a writer needs.

        Called after every callback ran the hook that produced them (train batch
        end, epoch end, test end, train end). Read ``logs``; do not change it.
        """

    def on_exception(self, error: BaseException) -> None:
        """``fit`` is failing with ``error``: release what you hold (files, traces, bars).

        The trainer state is the last completed step's. ``fit`` re-raises
        ``error`` after every callback ran this hook.
        """

    @property
    def state_key(self) -> str:
        return self._state_key or type(self).__qualname__

    @state_key.setter
    def state_key(self, key: str) -> None:
        self._state_key = key

    def state_dict(self) -> dict[str, Any]:
        """What to checkpoint so a resumed run continues where it stopped.

        It may hold arrays and plain values, nested in dicts with ``str`` keys, lists
        and tuples:

        * ``jax.Array`` s (an EMA of the weights, sharded like them) are saved as
          sharded arrays and restored into the sharding of the array, or of the
          ``jax.ShapeDtypeStruct``, at the same key of this callback's ``state_dict()``
          at restore time. A restore comes before ``on_train_begin``: a callback that
          builds its arrays there can give their layout in their place until then (e.g.
          from ``trainer.plan.state_targets()``); with nothing there, they are restored
          replicated on the trainer's mesh.
        * NumPy arrays and scalars are saved as arrays and come back as NumPy.
        * ``None``, ``bool``, ``int``, ``float``, ``str`` are saved as JSON; tuples come
          back as lists.

        Anything else (a set, a dict with non-``str`` keys, an object) is refused by the
        checkpoint's first save with a ``TypeError`` naming ``state_key`` and the key
        path; a ``jax.ShapeDtypeStruct`` must be replaced by its array before then. The
        plain values are copied when the save is taken; arrays are written after it
        returns, so replace a NumPy array rather than change it in place.
        """
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Puts back a ``state_dict()`` a checkpoint saved, before ``on_train_begin`` (of
        the ``fit`` whose ``on_fit_start`` restored it) or by ``restore_into``; with the
        types ``state_dict`` documents."""
        del state

    def layout_to_resume(self) -> str | None:
        """The layout (``repr`` of the strategy) of the run this callback will restore at
        the next ``fit``'s start, or ``None``. ``Trainer(strategy="auto")`` asks before it
        chooses, and keeps that layout rather than timing the candidates again, so a
        resumed run goes on as the uninterrupted one would. ``OrbaxCheckpoint`` answers."""
        return None


#: Every hook, in the order a fit meets them; the one list the dispatch is checked against.
HOOKS = tuple(name for name in vars(BaseCallback) if name.startswith("on_"))


class History(BaseCallback[Any]):
    """Records every value that lands in ``logs``, with the step it belongs to.

    ``history.history["train/loss"]`` is the list of values and
    ``history.steps["train/loss"]`` the global steps they were logged at.
    """

    def __init__(self) -> None:
        self.history: dict[str, list[float]] = {}
        self.steps: dict[str, list[int]] = {}

    def on_logs(self, step: int, logs: Logs) -> None:
        for key, value in logs.items():
            steps = self.steps.setdefault(key, [])
            if steps and steps[-1] == step:  # the same value seen by a later hook
                self.history[key][-1] = value
                continue
            steps.append(step)
            self.history.setdefault(key, []).append(value)

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history, "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = {k: list(v) for k, v in state["history"].items()}
        self.steps = {k: list(v) for k, v in state["steps"].items()}


def handed_batch(callbacks: Iterable[BaseCallback[Any]]) -> Any:
    """The last placed batch, as the first callback that asked for it holds it (``None``
    before the first step); for the deprecated ``MetricLog.last_batch``. Where no callback
    asked, none was kept: an error says how to ask."""
    for callback in callbacks:
        if callback.needs_batch:
            return callback.step_batch
    raise AttributeError(
        "MetricLog.last_batch: the placed batch is kept only for a callback that asks for "
        "it. Set needs_batch = True on the callback's class and read self.step_batch in "
        "its hooks (self.step_record.batch_shapes, the shapes, dtypes and shardings, needs "
        "no opt-in)."
    )


def _overrides(callback: BaseCallback[Any], hook: str) -> bool:
    # A hook set on the instance counts too (LambdaCallback style).
    return getattr(type(callback), hook) is not getattr(BaseCallback, hook) or hook in vars(
        callback
    )


def check_hook_names(callback: BaseCallback[Any]) -> None:
    """Raises on an ``on_...`` method that misspells a hook (it would never be called)."""
    names = {n for n in dir(type(callback)) if n.startswith("on_")} | {
        n for n in vars(callback) if n.startswith("on_")
    }
    for name in sorted(names - set(HOOKS)):
        close = difflib.get_close_matches(name, HOOKS, n=1, cutoff=0.85)
        if close:
            raise TypeError(
                f"{type(callback).__name__}.{name} is not a hook and would never be called; "
                f"did you mean {close[0]}? The hooks are: {', '.join(HOOKS)}."
            )


class CallbackList:
    """Dispatches each hook, in order, to the callbacks that override it; one method per hook.

    Skipping the no-op hooks keeps per-step dispatch free for callbacks that
    only act at epoch or train boundaries.
    """

    def __init__(self, callbacks: Iterable[BaseCallback[Any]], trainer: HookHost) -> None:
        self.trainer = trainer
        self.callbacks = sorted(callbacks, key=lambda c: c.order)
        keys: dict[str, BaseCallback[Any]] = {}
        for callback in self.callbacks:
            check_hook_names(callback)
            callback.set_trainer(trainer)
            if type(callback).state_dict is BaseCallback.state_dict:
                continue
            if callback.state_key in keys:
                raise ValueError(
                    f"Two callbacks, {keys[callback.state_key]!r} and {callback!r}, share the "
                    f"state_key {callback.state_key!r}, so a checkpoint cannot tell their "
                    "states apart. Set callback.state_key = '...' on one of them."
                )
            keys[callback.state_key] = callback
        self._stateful = keys
        for callback in self.callbacks:  # one used before holds another run's step
            callback.step_record, callback.step_batch = None, None
        self._batch_takers = [callback for callback in self.callbacks if callback.needs_batch]
        #: hook -> (bound method, the goodput part its time counts as), per overriding callback
        self._bound = {
            hook: [(getattr(c, hook), c.goodput) for c in self.callbacks if _overrides(c, hook)]
            for hook in HOOKS
        }

    def __iter__(self) -> Iterator[BaseCallback[Any]]:
        return iter(self.callbacks)

    def layout_to_resume(self) -> str | None:
        """The first callback's answer to ``Callback.layout_to_resume``."""
        answers = (callback.layout_to_resume() for callback in self.callbacks)
        return next((layout for layout in answers if layout is not None), None)

    def overrides(self, hook: str) -> bool:
        """Whether any callback overrides ``hook``: the loop skips a per-step hook none does."""
        return bool(self._bound[hook])

    def _call(self, hook: str, *args: Any) -> None:
        bound = self._bound[hook]
        if not bound:  # most hooks of most steps: no callback overrides them
            return
        timing = self.trainer.run.timings.timing
        for method, part in bound:
            with timing(part):
                method(*args)

    def _call_with_logs(self, hook: str, *args: Any) -> None:
        self._call(hook, *args)
        logs = args[-1]
        if logs:
            self.on_logs(self.trainer.step, logs)

    def hand_record(self, record: StepRecord, batch: Any = None) -> None:
        """Gives every callback the record of the step just taken (``step_record``), and
        those that ask for it (``needs_batch``) its placed ``batch`` (``step_batch``),
        before that step's hooks: what a hook reads of the step, rather than fetching it.
        No other callback keeps the batch, so its device memory is freed with the step."""
        for callback in self.callbacks:
            callback.step_record = record
        for callback in self._batch_takers:
            callback.step_batch = batch

    def on_logs(self, step: int, logs: Logs) -> None:
        """Hands finished ``logs`` to the writers: called after each hook that produced
        them, and by the trainer for logs no hook produced (``strategy="auto"``'s choice)."""
        self._call("on_logs", step, logs)

    def on_fit_start(self, logs: Logs) -> None:
        self._call("on_fit_start", logs)

    def on_train_begin(self, logs: Logs) -> None:
        self._call("on_train_begin", logs)

    def on_train_end(self, logs: Logs) -> None:
        self._call_with_logs("on_train_end", logs)

    def on_fit_end(self, logs: Logs) -> None:
        self._call("on_fit_end", logs)

    def on_epoch_begin(self, epoch: int, logs: Logs) -> None:
        self._call("on_epoch_begin", epoch, logs)

    def on_epoch_end(self, epoch: int, logs: Logs) -> None:
        self._call_with_logs("on_epoch_end", epoch, logs)

    def on_train_batch_begin(self, step: int, logs: Logs) -> None:
        self._call("on_train_batch_begin", step, logs)

    def on_train_batch_end(self, step: int, logs: Logs) -> None:
        self._call_with_logs("on_train_batch_end", step, logs)

    def on_step_end(self, step: int) -> None:
        self._call("on_step_end", step)

    def on_test_begin(self, logs: Logs) -> None:
        self._call("on_test_begin", logs)

    def on_test_end(self, logs: Logs) -> None:
        self._call_with_logs("on_test_end", logs)

    def on_test_batch_begin(self, step: int, logs: Logs) -> None:
        self._call("on_test_batch_begin", step, logs)

    def on_test_batch_end(self, step: int, logs: Logs) -> None:
        self._call("on_test_batch_end", step, logs)

    def on_exception(self, error: BaseException) -> None:
        """Every callback gets the hook, even if one of them fails in it (that is warned)."""
        for method, _ in self._bound["on_exception"]:
            try:
                method(error)
            except Exception as cleanup_error:  # noqa: BLE001 - the original error wins
                warnings.warn(
                    f"{method.__qualname__} failed while handling {type(error).__name__}: "
                    f"{cleanup_error!r}",
                    RuntimeWarning,
                    stacklevel=2,
                )

    # -- checkpointed state ------------------------------------------------------------
    def state_dict(self) -> dict[str, dict[str, Any]]:
        """``{state_key: callback.state_dict()}`` for every callback that has state (what
        each may hold: ``Callback.state_dict``)."""
        return {key: callback.state_dict() for key, callback in self._stateful.items()}

    def load_state_dict(self, states: dict[str, dict[str, Any]]) -> None:
        """Gives each callback its saved state; a callback absent from ``states`` keeps its
        own, and a state whose callback is not in this list is ignored."""
        for key, state in states.items():
            if key in self._stateful:
                self._stateful[key].load_state_dict(state)
