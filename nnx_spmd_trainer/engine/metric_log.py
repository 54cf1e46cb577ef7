"""What a log point writes into ``logs``, from three owners.

``LogSchedule`` (a trainer setting: when training metrics leave the devices),
``MetricLog`` (a plan's on-device accumulators and the last step's norms: the
``Run`` builds one for each plan it is given) and ``StepPerf`` (where the host's
time went: the run's, whatever the plan). Everything here reads arrays the step
left on the devices only when a log point asks, so a run pays one small
device-to-host read per log point. (``report`` is a ``PlanReport`` elsewhere:
what a step costs, before it runs.)
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import numpy as np
from clu import metrics as clu_metrics

from nnx_spmd_trainer import deprecation
from nnx_spmd_trainer.engine.hooks import CallbackList, Logs, handed_batch
from nnx_spmd_trainer.engine.speed import Speed
from nnx_spmd_trainer.engine.step_record import StepRecord

#: A 1-D metric of at most this many values is logged one scalar per index.
MAX_INDEXED = 64


def is_perf_key(key: str) -> bool:
    """Whether a logs key is one ``StepPerf`` adds (norms, perf, epoch), not a metric."""
    return key == "epoch" or key.startswith(("perf/", "goodput/")) or key.endswith("_norm")


def metric_logs(collection: clu_metrics.Collection, split: str, warned: set[str]) -> Logs:
    """``{"split/name": float}`` of a computed metrics collection.

    A vector (per-class accuracy) becomes one scalar per index,
    ``split/name/i``; anything larger is named in a warning once (``warned``
    remembers) and left out.
    """
    local = jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), collection)
    logs: Logs = {}
    for name, value in local.compute().items():
        value = np.asarray(value)
        key = f"{split}/{name}"
        if value.size == 1:
            logs[key] = float(value)
        elif value.ndim == 1 and value.size <= MAX_INDEXED:
            logs.update({f"{key}/{i}": float(v) for i, v in enumerate(value)})
        elif key not in warned:
            warned.add(key)
            warnings.warn(
                f"Metric {key} has shape {value.shape}: logs hold scalars and vectors of up "
                f"to {MAX_INDEXED} values (one scalar per index), so it is not logged. "
                "Reduce it in the metric, or read trainer.metric_log.train.compute() yourself.",
                stacklevel=3,
            )
    return logs


def device_memory_gb(devices: Sequence[jax.Device]) -> float | None:
    """The most memory in use on one of ``devices`` (GB), where the backend reports it."""
    used = [
        stats["bytes_in_use"]
        for device in devices
        if (stats := device.memory_stats()) and "bytes_in_use" in stats
    ]
    return max(used) / 1e9 if used else None


#: Where the wall time of ``fit`` goes; every second lands in exactly one of them.
GOODPUT = ("compile", "data_wait", "step", "eval", "checkpoint", "callbacks", "other")


class LogSchedule:
    """When training metrics leave the devices: a trainer setting (``trainer.log_schedule``).

    ``Trainer(log_every_n_steps=n, track_norms=...)`` sets it; a callback that writes
    metrics adds its interval (``MetricsLogger``: ``request_log_every``). It belongs to
    the trainer, not to a plan: ``strategy="auto"`` choosing a layout leaves it alone.

    Attributes:
      track_norms: whether log points carry the global norms (a step that ends at one
        computes them).
    """

    def __init__(self, log_every_n_steps: int | None = None, *, track_norms: bool = True) -> None:
        self.track_norms = track_norms
        self._log_every: tuple[int, ...] = ()
        if log_every_n_steps is not None:
            self.request_log_every(log_every_n_steps)

    def request_log_every(self, n: int) -> None:
        """Training metrics reach ``logs`` every ``n`` steps (each request adds its steps)."""
        if n < 1:
            raise ValueError(f"log_every_n_steps must be >= 1, got {n}.")
        self._log_every = tuple(sorted({*self._log_every, n}))

    @property
    def log_every(self) -> tuple[int, ...]:
        """The intervals asked for (``request_log_every``)."""
        return self._log_every

    def is_log_step(self, step: int) -> bool:
        """Whether training metrics are flushed into ``logs`` after ``step``."""
        return any(step % n == 0 for n in self._log_every)

    def norms_at(self, step: int) -> bool:
        """Whether the step that ends at ``step`` computes the global norms."""
        return self.track_norms and self.is_log_step(step)


class StepPerf:
    """Where the host's time went over the run (``trainer.run.timings``).

    Time is split without overlap (``timing`` blocks nest; an inner block's time is
    its own, not its outer block's) into ``GOODPUT``: tracing and compiling,
    waiting for training batches with no step computing, training steps (dispatch,
    the waits of the in-flight bound, and batches taken while a step computes),
    evaluating, the blocked part of checkpoint saves, other callbacks, and the rest.
    The parts add up to the wall time of ``fit``.
    """

    def __init__(self, devices: Sequence[jax.Device] | None = None) -> None:
        #: Where ``perf/device_memory_gb`` is read (default: this process's devices).
        self.devices = list(jax.local_devices() if devices is None else devices)
        #: Seconds over the trainer's life, by ``GOODPUT`` part.
        self.seconds = dict.fromkeys(GOODPUT, 0.0)
        #: The training steps' tokens and FLOPs, read as rates with the time (``Speed``).
        self.speed = Speed()
        self._stack = ["other"]  # the part the time now goes to is the last
        self._since = time.perf_counter()
        self.restart()

    def restart(self) -> None:
        """The next read covers the time from now, and so does goodput (a ``fit`` starts)."""
        now = self._charge()
        self._read_at, self._seconds_read = now, dict(self.seconds)
        self._fit_start, self._seconds_at_fit = now, dict(self.seconds)
        self.speed.reset()

    @property
    def compile_seconds(self) -> float:
        return self.seconds["compile"]

    def _charge(self) -> float:
        now = time.perf_counter()
        self.seconds[self._stack[-1]] += now - self._since
        self._since = now
        return now

    def timing(self, what: str) -> contextlib.AbstractContextManager[None]:
        """``with perf.timing("compile"): ...``: the block's time goes to ``seconds[what]``.

        A name not in ``GOODPUT`` becomes a part of its own, reported beside them
        (``goodput/<what>_s``): a trainer's own phase, such as ``GRPOTrainer``'s
        ``rollout`` and ``reference`` inside its step (nested: the step keeps the rest).
        """
        self.seconds.setdefault(what, 0.0)
        return _Timer(self, what)

    def waiting_for_data(
        self, stepping: Callable[[], bool]
    ) -> contextlib.AbstractContextManager[None]:
        """Taking a batch: its time is ``data_wait``, unless ``stepping()`` says, at its end,
        that a dispatched step is still computing. Steps finish in order, so the devices
        were busy the whole time: the batch was taken beside a step, and the time is the
        step's (``data_wait`` counts only time the devices may have sat idle)."""
        return _Timer(self, "data_wait", overlapped=(stepping, "step"))

    def goodput(self) -> Logs:
        """``goodput/<part>_s``: seconds of each part since ``fit`` began, and
        ``goodput/wall_s``, their sum, the wall time since then."""
        now = self._charge()
        parts = {
            f"goodput/{k}_s": v - self._seconds_at_fit.get(k, 0.0) for k, v in self.seconds.items()
        }
        return {**parts, "goodput/wall_s": now - self._fit_start}

    def read(self) -> Logs:
        """``perf/compile_time_s`` when a step was compiled since the last read;
        ``perf/data_wait_fraction``, the share of the training time since then
        (compiling and evaluating left out) spent waiting for batches;
        ``perf/device_memory_gb``; the ``speed`` over that time (``perf/tokens_per_s``,
        ``perf/flops_per_s_per_device``, ``perf/mfu``); and the ``goodput``."""
        logs = self.goodput()
        now = self._since
        spent = {k: v - self._seconds_read.get(k, 0.0) for k, v in self.seconds.items()}
        if spent["compile"] > 0:
            logs["perf/compile_time_s"] = spent["compile"]
        training = now - self._read_at - spent["compile"] - spent["eval"]
        if training > 0:
            logs["perf/data_wait_fraction"] = min(spent["data_wait"] / training, 1.0)
        logs.update(self.speed.read(training, self.devices[0] if self.devices else None))
        self._read_at, self._seconds_read = now, dict(self.seconds)
        if (memory := device_memory_gb(self.devices)) is not None:
            logs["perf/device_memory_gb"] = memory
        return logs


class _Timer:
    def __init__(
        self, perf: StepPerf, what: str, *, overlapped: tuple[Callable[[], bool], str] | None = None
    ) -> None:
        self.perf, self.what, self.overlapped = perf, what, overlapped

    def __enter__(self) -> None:
        self.perf._charge()
        self.perf._stack.append(self.what)

    def __exit__(self, *exc: Any) -> None:
        if self.overlapped is not None and self.overlapped[0]():
            self.perf._stack[-1] = self.overlapped[1]
        self.perf._charge()
        self.perf._stack.pop()


class _Owner(Protocol):
    """The run a ``MetricLog`` belongs to (a ``Run``), for the deprecated names only."""

    schedule: LogSchedule
    timings: StepPerf
    last_step: StepRecord | None
    callbacks: CallbackList | None


def _callbacks_of(log: MetricLog) -> CallbackList:
    callbacks = _run_of(log).callbacks
    if callbacks is None:
        raise AttributeError("This MetricLog's run has no callbacks yet.")
    return callbacks


def _run_of(log: MetricLog) -> _Owner:
    if log._run is None:
        raise AttributeError("This MetricLog belongs to no trainer's run.")
    return log._run


class MetricLog:
    """A plan's training and evaluation metrics on the devices (``trainer.metric_log``).

    The ``Run`` builds one for each plan it is given. The accumulators stay on the
    devices between log points; ``flush`` is the single device-to-host read of a log
    point, with the last step's norms and what the run's timings (``StepPerf``) add.

    Attributes:
      train, eval: the on-device ``clu.metrics.Collection`` accumulators.
      train_steps: steps accumulated in ``train`` since the last flush.
      norms: the global norms of the last step that computed them, still on device.
    """

    def __init__(
        self,
        empty: Callable[[], clu_metrics.Collection],
        *,
        run: Any = None,
    ) -> None:
        self.empty = empty
        self.train, self.eval = empty(), empty()
        self.train_steps = 0
        self.norms: dict[str, jax.Array] = {}
        self._run: _Owner | None = run  # the Run: only for the deprecated names below
        self._warned: set[str] = set()

    def compute(self, split: str = "train") -> Logs:
        """Host floats of the ``split`` metrics accumulated since the last reset.

        Values are global (computed over the whole sharded batch), so one replica suffices.
        """
        if split == "train" and self.train_steps == 0:
            return {}
        return metric_logs(self.train if split == "train" else self.eval, split, self._warned)

    def reset(self, split: str = "train") -> None:
        if split == "train":
            self.train, self.train_steps = self.empty(), 0
        else:
            self.eval = self.empty()

    def flush(self, epoch: int, perf: StepPerf) -> Logs:
        """Computes and resets the training metrics: ``{"train/loss": ...}``, with the
        last step's norms (``train/{grad,update,param}_norm``), what ``perf`` reads
        (compile time, data wait, device memory, goodput) and the epoch."""
        logs = self.compute("train")
        if logs:
            logs.update({f"train/{k}": float(v) for k, v in jax.device_get(self.norms).items()})
            logs.update(perf.read(), epoch=float(epoch))
        if self.train_steps:  # else still empty: fit's final flush after an epoch's costs no
            self.reset("train")  # second dispatch of a fresh collection
        return logs

    # -- the 0.1 names of what is now the run's or the trainer's setting -------------------
    perf = deprecation.renamed_property(
        "MetricLog.perf", "trainer.run.timings", lambda log: _run_of(log).timings
    )
    last_loss = deprecation.renamed_property(
        "MetricLog.last_loss",
        "trainer.last_step.loss (a StepRecord)",
        lambda log: (step := _run_of(log).last_step) and step.loss,
    )
    last_batch = deprecation.renamed_property(
        "MetricLog.last_batch",
        "self.step_record.batch_shapes in a callback (the shapes a hook needs), or "
        "self.step_batch with needs_batch = True on its class",
        lambda log: handed_batch(_callbacks_of(log)),
    )
    track_norms = deprecation.renamed_property(
        "MetricLog.track_norms",
        "trainer.log_schedule.track_norms",
        lambda log: _run_of(log).schedule.track_norms,
        lambda log, value: setattr(_run_of(log).schedule, "track_norms", value),
    )
    log_every = deprecation.renamed_property(
        "MetricLog.log_every",
        "trainer.log_schedule.log_every",
        lambda log: _run_of(log).schedule.log_every,
    )

    def request_log_every(self, n: int) -> None:
        """Deprecated: ``trainer.log_schedule.request_log_every(n)``."""
        deprecation.warn_renamed(
            "MetricLog.request_log_every", "trainer.log_schedule.request_log_every"
        )
        _run_of(self).schedule.request_log_every(n)

    def is_log_step(self, step: int) -> bool:
        """Deprecated: ``trainer.log_schedule.is_log_step(step)``."""
        deprecation.warn_renamed("MetricLog.is_log_step", "trainer.log_schedule.is_log_step")
        return _run_of(self).schedule.is_log_step(step)
