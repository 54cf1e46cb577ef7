"""CSVLogger: one CSV row per log point."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import jax
from typing_extensions import override

from nnx_spmd_trainer import Callback, Logs


class CSVLogger(Callback):
    """Appends ``{"step": ..., **logs}`` to a CSV file at every log point.

    A log point is any hook whose ``logs`` is not empty: a ``MetricsLogger``
    step, an epoch end, an evaluation, the end of fit. Train and eval values
    logged at the same step give two rows with the same ``step``; cells a row
    does not have are empty.

    Keys that appear later (the first evaluation, ``lr``) widen the header:
    the file is rewritten once with the union of columns, atomically
    (temporary file + ``os.replace``), so the file on disk is always a valid
    CSV. The file is opened and closed per row: log points are rare, and a
    crash loses nothing already logged. Written by process 0 only.

    Args:
      path: the CSV file; its directory is created.
      append: keep an existing file and its columns (a resumed run);
        otherwise the file is started afresh when fit begins.

    Example::

        Trainer(..., callbacks=[MetricsLogger(10), CSVLogger("runs/a/metrics.csv")])
        # step,train/loss,train/accuracy,eval/loss,...
    """

    def __init__(self, path: str | os.PathLike[str], *, append: bool = False) -> None:
        self.path = Path(path)
        self.append = append
        self.columns: list[str] = []
        self._opened = False

    def _open(self, fresh: bool) -> None:
        self._opened = True
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not fresh and self.path.exists() and self.path.stat().st_size:
            with self.path.open(newline="") as f:
                self.columns = [c for c in next(csv.reader(f), []) if c != "step"]
        else:
            self.columns = []
            self.path.write_text("")

    def _rewrite_header(self, keep_through_step: int | None = None) -> None:
        with self.path.open(newline="") as f:
            rows = list(csv.DictReader(f))
        if keep_through_step is not None:
            rows = [row for row in rows if int(row["step"]) <= keep_through_step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        with tmp.open("w", newline="") as f:
            writer = csv.DictWriter(f, ["step", *self.columns], restval="")
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, self.path)

    def write(self, step: int, logs: Logs) -> None:
        """Writes one row (a no-op for empty ``logs`` or on processes other than 0)."""
        if not logs or jax.process_index() != 0:
            return
        if not self._opened:
            self._open(fresh=not self.append)
        new = [key for key in logs if key not in self.columns]
        if new:
            self.columns.extend(new)
            self._rewrite_header()
        with self.path.open("a", newline="") as f:
            csv.DictWriter(f, ["step", *self.columns], restval="").writerow({"step": step, **logs})

    @override
    def on_train_begin(self, logs: Logs) -> None:
        if jax.process_index() != 0:
            return
        self._open(fresh=not self.append and not self._opened)
        if self.append and self.columns:
            # A resumed run redoes the steps after its checkpoint: their old rows go.
            self._rewrite_header(keep_through_step=self.trainer.step)

    @override
    def on_logs(self, step: int, logs: Logs) -> None:
        self.write(step, logs)
