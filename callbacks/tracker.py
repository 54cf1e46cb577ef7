"""What MLflowLogger and WandbLogger share: one tracker run, written by process 0, kept
across resumes, and never a reason for training to stop."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar

import jax
from typing_extensions import override

from nnx_spmd_trainer import Callback, Logs

from .plan_text import plan_report_for
from .tensorboard import flatten_config

T = TypeVar("T")


def import_tracker(module: str, extra: str) -> ModuleType:
    """``module`` imported, or an ``ImportError`` naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"{module!r} is not installed ({error}); install it with "
            f"`pip install nnx-spmd-trainer[{extra}]` (or `pip install {extra}`)."
        ) from error


class TrackerLogger(Callback):
    """A tracker run that continues where a resumed run continues.

    Subclasses say how to open, write and close their tracker's run (``_open``,
    ``_log_metrics``, ``_log_params``, ``_log_text``, ``_close``); this class decides
    what and when:

    * only process 0 talks to the tracker;
    * at the start, the run config flattened (``{"model.width": 64}``) as parameters,
      and, with ``strategy="auto"``, the ranking of the layouts (``layout.md``);
    * the plan report of the train step (``plan.txt``), from the ``auto`` choice, else
      at the first step (the step is compiled by then: a cache hit);
    * every value ``on_logs`` hands it (the ``logs`` TensorBoard writes as scalars), at
      its global step;
    * the run's id in ``state_dict()``, so it is in every checkpoint, known before the
      first one: a run resumed from a checkpoint writes into the same tracker run. A
      run killed before its first checkpoint starts over, in a new tracker run;
    * a tracker that fails (no server, no network, a full disk) warns once, is left
      alone for the rest of ``fit``, and training goes on.
    """

    #: The name in warnings: "MLflow", "W&B".
    tracker = "tracker"

    def __init__(self) -> None:
        self.run_id: str | None = None
        self._active = False  # a tracker run is open on this process
        self._plan_due = False
        #: key -> the last step an earlier attempt of this run logged it at (resume)
        self._logged_through: dict[str, int] = {}

    # -- what a tracker implements ----------------------------------------------------
    def _open(self, run_id: str | None) -> str:
        """Opens (or, given ``run_id``, re-opens) the tracker run; returns its id."""
        raise NotImplementedError

    def _logged_steps(self) -> dict[str, int]:
        """Per key, the last step the re-opened run already holds (empty for a new run)."""
        return {}

    def _is_new(self, key: str, step: int) -> bool:
        """Whether ``key`` at ``step`` is not yet in the re-opened run."""
        return step > self._logged_through.get(key, -1)

    def _log_params(self, params: dict[str, Any]) -> None:
        raise NotImplementedError

    def _log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def _log_text(self, name: str, text: str) -> None:
        raise NotImplementedError

    def _close(self, failed: bool) -> None:
        raise NotImplementedError

    def log_text(self, name: str, text: str) -> None:
        """``text`` as a file ``name`` of the tracker's run (an MLflow artifact, a W&B
        run file), from process 0 while ``fit`` runs; a failure warns once, as any other.
        What ``SampleCallback`` logs its samples with."""
        self._guarded(f"log {name}", lambda: self._log_text(name, text))

    # -- the one place a tracker's failure is caught -----------------------------------
    def _guarded(self, what: str, action: Callable[[], T]) -> T | None:
        if not self._active:
            return None
        try:
            return action()
        except Exception as error:  # noqa: BLE001 - a tracker must never stop a run
            self._active = False
            warnings.warn(
                f"{type(self).__name__}: {self.tracker} failed to {what} ({error!r}); "
                "training goes on without it for the rest of this fit.",
                RuntimeWarning,
                stacklevel=3,
            )
            return None

    def _start(self) -> None:
        self._active = True
        resumed = self.run_id is not None
        run_id = self._guarded("open its run", lambda: self._open(self.run_id))
        if run_id is None:
            return
        self.run_id = run_id
        logged = self._guarded("read what it logged", self._logged_steps) if resumed else None
        self._logged_through = logged or {}

    # -- hooks -------------------------------------------------------------------------
    @override
    def on_train_begin(self, logs: Logs) -> None:
        if jax.process_index() != 0:
            return
        self._start()
        params = flatten_config(self.trainer.config)
        if params:
            self._guarded("log the config", lambda: self._log_params(params))
        choice = self.trainer.layout_choice
        if choice is not None:
            self._guarded("log the layout", lambda: self._log_text("layout.md", choice.markdown()))
            self._guarded("log the plan", lambda: self._log_text("plan.txt", str(choice.report)))
        else:
            self._plan_due = True  # at the first step: its batch gives the shapes

    @override
    def on_train_batch_end(self, step: int, logs: Logs) -> None:
        if not self._plan_due:
            return
        self._plan_due = False
        if not self._active:
            return
        report = plan_report_for(self.step_record, self.trainer, type(self).__name__)
        if report is None:
            return
        self._guarded("log the plan", lambda: self._log_text("plan.txt", str(report)))

    @override
    def on_logs(self, step: int, logs: Logs) -> None:
        # Steps an earlier attempt logged after its last checkpoint come again after a
        # resume: the tracker keeps the first attempt's values, once.
        metrics = {k: v for k, v in logs.items() if self._is_new(k, step)}
        if metrics:
            self._guarded("log metrics", lambda: self._log_metrics(step, metrics))

    @override
    def on_fit_end(self, logs: Logs) -> None:
        self._finish(failed=False)

    @override
    def on_exception(self, error: BaseException) -> None:
        self._finish(failed=True)

    def _finish(self, failed: bool) -> None:
        self._guarded("close its run", lambda: self._close(failed))
        self._active = False

    # -- checkpointed --------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id}

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.run_id = state.get("run_id") or None
