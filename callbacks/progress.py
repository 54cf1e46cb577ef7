"""ProgressBar: a tqdm bar on a terminal, quiet (or plain lines, if asked) anywhere else."""

from __future__ import annotations

import sys
from typing import IO

import jax
from tqdm.auto import tqdm
from typing_extensions import override

from nnx_spmd_trainer import Callback, Logs, is_perf_key


def format_logs(logs: Logs) -> str:
    """``{"train/loss": 0.123456}`` -> ``"train/loss=0.1235"``, keys sorted."""
    return " ".join(f"{key}={value:.4g}" for key, value in sorted(logs.items()))


class ProgressBar(Callback):
    """Shows training progress on process 0.

    On a terminal it is a tqdm bar advanced once per step (host-side only)
    with the latest logged values as its postfix. When the output is not a
    TTY (CI, log files, captured output) it is quiet, or, with ``plain=True``,
    prints one line ``step N: key=value ...`` per log point. Processes other
    than 0 print nothing.

    Args:
      total: the number of steps, for the bar's length and ETA (fit's
        ``max_steps``); default ``trainer.progress.max_steps``, or a plain counter
        when fit runs by epochs.
      file: where to write; default ``sys.stdout`` at the time fit begins.
      use_tqdm: force the bar on or off; default: on when ``file`` is a TTY.
      plain: without a bar, print a line per log point instead of nothing.

    Example::

        trainer = Trainer(..., callbacks=[MetricsLogger(20), ProgressBar(total=1000)])
        trainer.fit(data, max_steps=1000)
    """

    def __init__(
        self,
        total: int | None = None,
        *,
        file: IO[str] | None = None,
        use_tqdm: bool | None = None,
        plain: bool = False,
    ) -> None:
        self.total = total
        self.file = file
        self.use_tqdm = use_tqdm
        self.plain = plain
        self._bar: tqdm | None = None
        self._out: IO[str] = sys.stdout

    def _print(self, step: int, logs: Logs) -> None:
        logs = {k: v for k, v in logs.items() if not is_perf_key(k)}  # metrics only
        if not logs or jax.process_index() != 0:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(format_logs(logs), refresh=False)
        elif self.plain:
            print(f"step {step}: {format_logs(logs)}", file=self._out, flush=True)

    @override
    def on_train_begin(self, logs: Logs) -> None:
        self._out = self.file if self.file is not None else sys.stdout
        if jax.process_index() != 0:
            return
        use_tqdm = self.use_tqdm
        if use_tqdm is None:
            use_tqdm = bool(getattr(self._out, "isatty", lambda: False)())
        if use_tqdm:
            total = self.total
            if total is None:
                total = self.trainer.progress.max_steps
            self._bar = tqdm(total=total, initial=self.trainer.step, file=self._out, desc="train")

    @override
    def on_train_batch_end(self, step: int, logs: Logs) -> None:
        if self._bar is not None:
            self._bar.update(step - self._bar.n)

    @override
    def on_logs(self, step: int, logs: Logs) -> None:
        self._print(step, logs)

    @override
    def on_train_end(self, logs: Logs) -> None:
        if self._bar is not None:
            self._print(self.trainer.step, logs)  # the final values, before on_logs comes
            self.close()

    @override
    def on_exception(self, error: BaseException) -> None:
        self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
