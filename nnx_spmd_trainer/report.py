"""What a log point reports: metric values on the host, step norms, compile time, device memory.

Everything here reads arrays the step left on the devices only when a log
point asks, so a run pays one small device-to-host read per log point.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from clu import metrics as clu_metrics

Logs = dict[str, float]

#: A 1-D metric of at most this many values is logged one scalar per index.
MAX_INDEXED = 64


def is_step_report(key: str) -> bool:
    """Whether a logs key is one ``StepReport`` adds (norms, perf, epoch), not a metric."""
    return key == "epoch" or key.startswith("perf/") or key.endswith("_norm")


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
                "Reduce it in the metric, or read trainer.train_metrics.compute() yourself.",
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


class StepReport:
    """The last step's norms (left on the devices) and the compile time since the last read."""

    def __init__(self, devices: Sequence[jax.Device]) -> None:
        self.devices = list(devices)
        self.norms: dict[str, jax.Array] = {}
        #: Seconds spent tracing and compiling train steps, over the trainer's life.
        self.compile_seconds = 0.0
        self._compile_reported = 0.0

    def compiling(self) -> _Timer:
        """``with report.compiling(): first_call()`` adds its time to ``compile_seconds``."""
        return _Timer(self)

    def read(self) -> Logs:
        """``train/{grad,update,param}_norm`` of the last step, ``perf/compile_time_s``
        when a step was compiled since the last read, and ``perf/device_memory_gb``."""
        logs = {f"train/{k}": float(v) for k, v in jax.device_get(self.norms).items()}
        if self.compile_seconds > self._compile_reported:
            logs["perf/compile_time_s"] = self.compile_seconds - self._compile_reported
            self._compile_reported = self.compile_seconds
        if (memory := device_memory_gb(self.devices)) is not None:
            logs["perf/device_memory_gb"] = memory
        return logs


class _Timer:
    def __init__(self, report: StepReport) -> None:
        self.report = report

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        self.report.compile_seconds += time.perf_counter() - self.start
