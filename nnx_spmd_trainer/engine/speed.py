"""Speed: the tokens and FLOPs of the training steps between two log points, as rates.

The loop hands ``Speed`` each step's tokens (``flops.batch_tokens`` of its global batch)
and its compiled program's FLOPs per device (``flops.step_flops``, read once per
compiled step); ``StepPerf.read`` divides them by the training time since the last log
point (compiling and evaluating left out) into ``perf/tokens_per_s``,
``perf/flops_per_s_per_device`` and, where a peak is known, ``perf/mfu``.
"""

from __future__ import annotations

import logging
import math

import jax

from nnx_spmd_trainer.engine.hooks import Logs
from nnx_spmd_trainer.planner import flops as flops_lib

log = logging.getLogger(__name__)


class Speed:
    """Tokens and FLOPs since the last read, and the device's peak (``run.timings.speed``).

    Args:
      peak_flops: one device's peak FLOP/s, the MFU's denominator. Default: the dense
        bf16 peak of the device's kind in ``flops.PEAK_FLOPS`` (``flops.peak_flops(kind,
        "fp32")`` for a float32 model on a GPU); a device not in the table gets no
        ``perf/mfu``, and a one-time note (``note``) says why.

    >>> speed = Speed(peak_flops=1e12)
    >>> speed.add_step(tokens=1024, flops=2e9)
    >>> speed.add_step(tokens=1024, flops=2e9)
    >>> speed.read(seconds=0.5)
    {'perf/tokens_per_s': 4096.0, 'perf/flops_per_s_per_device': 8000000000.0, 'perf/mfu': 0.008}
    """

    def __init__(self, peak_flops: float | None = None) -> None:
        if peak_flops is not None and not (
            isinstance(peak_flops, int | float) and math.isfinite(peak_flops) and peak_flops > 0
        ):
            raise ValueError(
                f"peak_flops={peak_flops!r}: give one device's peak FLOP/s as a positive "
                "number (989.4e12 for an H100 SXM in bf16), or None to look it up by the "
                "device's kind (nnx_spmd_trainer.planner.flops.PEAK_FLOPS)."
            )
        self.peak_flops = peak_flops
        #: Why no ``perf/mfu`` is logged (set at the first read without a peak), else ``None``.
        self.note: str | None = None
        self.reset()

    def reset(self) -> None:
        """Forgets the steps since the last read (a ``fit`` starts)."""
        self._tokens: int | None = 0
        self._flops: float | None = 0.0

    def add_step(self, *, tokens: int | None, flops: float | None) -> None:
        """One training step: its global batch's tokens and its FLOPs per device
        (``None``: unknown; a rate over an interval with such a step is not logged)."""
        self._tokens = None if tokens is None or self._tokens is None else self._tokens + tokens
        self._flops = None if flops is None or self._flops is None else self._flops + flops

    def peak(self, device: jax.Device | None) -> float | None:
        """The setting, else the table's bf16 peak for ``device``'s kind; ``None`` (and the
        note, logged once) where neither gives one."""
        if self.peak_flops is not None:
            return self.peak_flops
        kind = device.device_kind if device is not None else "unknown"
        found = flops_lib.peak_flops(kind)
        if found is None and self.note is None:
            self.note = (
                f"no perf/mfu: device kind {kind!r} is not in the peak FLOP/s table "
                "(nnx_spmd_trainer.planner.flops.PEAK_FLOPS); give one device's peak as "
                "Trainer(peak_flops=...) (--config.peak_flops=... on the command line) "
                "to log it"
            )
            on_cpu = device is not None and device.platform == "cpu"
            log.log(logging.INFO if on_cpu else logging.WARNING, self.note)
        return found

    def read(self, seconds: float, device: jax.Device | None = None) -> Logs:
        """The rates of the steps since the last read over ``seconds`` of training, then
        forgets them: ``perf/tokens_per_s`` (global), ``perf/flops_per_s_per_device`` and
        ``perf/mfu`` (that over the peak of ``device``, one of the run's)."""
        tokens, flops = self._tokens, self._flops
        self.reset()
        logs: Logs = {}
        if seconds <= 0:
            return logs
        if tokens:
            logs["perf/tokens_per_s"] = tokens / seconds
        if flops:
            logs["perf/flops_per_s_per_device"] = flops / seconds
            if (peak := self.peak(device)) is not None:
                logs["perf/mfu"] = flops / seconds / peak
        return logs
