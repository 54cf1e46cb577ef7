"""MetricLog: the run's metrics on the devices, and what a log point writes into ``logs``.

Metric values on the host, step norms, compile time, device memory. Everything
here reads arrays the step left on the devices only when a log point asks, so a
run pays one small device-to-host read per log point. (``report`` is a
``PlanReport`` elsewhere: what a step costs, before it runs.)
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from clu import metrics as clu_metrics

from nnx_spmd_trainer.engine.callback import Logs

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


class StepPerf:
    """The last step's norms (left on the devices), and where the host's time went.

    Time is split without overlap (``timing`` blocks nest; an inner block's time is
    its own, not its outer block's) into ``GOODPUT``: tracing and compiling,
    waiting for training batches, training steps (dispatch and the waits of the
    in-flight bound), evaluating, the blocked part of checkpoint saves, other
    callbacks, and the rest. The parts add up to the wall time of ``fit``.
    """

    def __init__(self, devices: Sequence[jax.Device]) -> None:
        self.devices = list(devices)
        self.norms: dict[str, jax.Array] = {}
        #: Seconds over the trainer's life, by ``GOODPUT`` part.
        self.seconds = dict.fromkeys(GOODPUT, 0.0)
        self._stack = ["other"]  # the part the time now goes to is the last
        self._since = time.perf_counter()
        self.restart()

    def restart(self) -> None:
        """The next read covers the time from now, and so does goodput (a ``fit`` starts)."""
        now = self._charge()
        self._read_at, self._seconds_read = now, dict(self.seconds)
        self._fit_start, self._seconds_at_fit = now, dict(self.seconds)

    @property
    def compile_seconds(self) -> float:
        return self.seconds["compile"]

    def _charge(self) -> float:
        now = time.perf_counter()
        self.seconds[self._stack[-1]] += now - self._since
        self._since = now
        return now

    def timing(self, what: str) -> _Timer:
        """``with perf.timing("compile"): ...``: the block's time goes to ``seconds[what]``."""
        return _Timer(self, what)

    def goodput(self) -> Logs:
        """``goodput/<part>_s``: seconds of each part since ``fit`` began, and
        ``goodput/wall_s``, their sum, the wall time since then."""
        now = self._charge()
        parts = {f"goodput/{k}_s": v - self._seconds_at_fit[k] for k, v in self.seconds.items()}
        return {**parts, "goodput/wall_s": now - self._fit_start}

    def read(self) -> Logs:
        """``train/{grad,update,param}_norm`` of the last step; ``perf/compile_time_s`` when
        a step was compiled since the last read; ``perf/data_wait_fraction``, the share
        of the training time since then (compiling and evaluating left out) spent
        waiting for batches; ``perf/device_memory_gb``; and the ``goodput``."""
        logs = {f"train/{k}": float(v) for k, v in jax.device_get(self.norms).items()}
        logs.update(self.goodput())
        now = self._since
        spent = {k: v - self._seconds_read[k] for k, v in self.seconds.items()}
        if spent["compile"] > 0:
            logs["perf/compile_time_s"] = spent["compile"]
        training = now - self._read_at - spent["compile"] - spent["eval"]
        if training > 0:
            logs["perf/data_wait_fraction"] = min(spent["data_wait"] / training, 1.0)
        self._read_at, self._seconds_read = now, dict(self.seconds)
        if (memory := device_memory_gb(self.devices)) is not None:
            logs["perf/device_memory_gb"] = memory
        return logs


class _Timer:
    def __init__(self, perf: StepPerf, what: str) -> None:
        self.perf, self.what = perf, what

    def __enter__(self) -> None:
        self.perf._charge()
        self.perf._stack.append(self.what)

    def __exit__(self, *exc: Any) -> None:
        self.perf._charge()
        self.perf._stack.pop()


class MetricLog:
    """The training and evaluation metrics on the devices, and when they are logged
    (``trainer.metric_log``).

    The accumulators stay on the devices between log points; ``flush`` is the
    single device-to-host read of a log point, with what ``perf`` (the step
    norms and host timings) adds.

    Attributes:
      train, eval: the on-device ``clu.metrics.Collection`` accumulators.
      train_steps: steps accumulated in ``train`` since the last flush.
      last_loss, last_batch: the last step's loss and global batch, still on
        device (read them only when needed).
      perf: norms and timings (``StepPerf``).
      track_norms: whether log points carry the global norms.
    """

    def __init__(
        self,
        empty: Callable[[], clu_metrics.Collection],
        devices: Sequence[jax.Device],
        *,
        track_norms: bool = True,
    ) -> None:
        self.empty = empty
        self.perf = StepPerf(devices)
        self.track_norms = track_norms
        self.train, self.eval = empty(), empty()
        self.train_steps = 0
        self.last_loss: jax.Array | None = None
        self.last_batch: Any = None
        self._log_every: tuple[int, ...] = ()
        self._warned: set[str] = set()

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

    def flush(self, epoch: int) -> Logs:
        """Computes and resets the training metrics: ``{"train/loss": ...}``, with the
        last step's norms, compile time and device memory (``perf``) and the epoch."""
        logs = self.compute("train")
        if logs:
            logs.update(self.perf.read(), epoch=float(epoch))
        self.reset("train")
        return logs
