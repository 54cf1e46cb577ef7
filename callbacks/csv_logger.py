"""CSVLogger: one CSV row per logged step."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import jax
from typing_extensions import override

from nnx_spmd_trainer import Callback, Logs


class CSVLogger(Callback):
    """Writes ``{"step": ..., **logs}`` to a CSV file: one row per step that logged.

    A log point is any hook whose ``logs`` is not empty: a ``MetricsLogger``
    step, an epoch end, an evaluation, the end of fit. Values logged at the
    step of the last row (an evaluation after the training metrics of its
    step) join that row: one row per step. Cells a row does not have are empty.

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
        # the last row written, its step and where it starts: a later log point of the
        # same step rewrites it with both (the file is cut there, the merged row appended)
        self._last: tuple[int, Logs, int] | None = None

    def _open(self, fresh: bool) -> None:
        self._opened = True
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not fresh and self.path.exists() and self.path.stat().st_size:
            with self.path.open(newline="") as f:
                self.columns = [c for c in next(csv.reader(f), []) if c != "step"]
        else:
            self.columns = []
            self.path.write_text("")

    def _rewrite_header(
        self, keep_through_step: int | None = None, *, drop_last: bool = False
    ) -> None:
        with self.path.open(newline="") as f:
            rows = list(csv.DictReader(f))
        if keep_through_step is not None:
            rows = [row for row in rows if int(row["step"]) <= keep_through_step]
        if drop_last:
            rows = rows[:-1]
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
        same_step = self._last is not None and self._last[0] == step
        row = {**self._last[1], **logs} if self._last is not None and same_step else dict(logs)
        new = [key for key in logs if key not in self.columns]
        if new:
            self.columns.extend(new)
            self._rewrite_header(drop_last=same_step)
        elif self._last is not None and same_step:
            with self.path.open("r+b") as f:
                f.truncate(self._last[2])
        start = self.path.stat().st_size
        with self.path.open("a", newline="") as f:
            csv.DictWriter(f, ["step", *self.columns], restval="").writerow({"step": step, **row})
        self._last = (step, row, start)

    @override
    def on_train_begin(self, logs: Logs) -> None:
        if jax.process_index() != 0:
            return
        self._last = None
        self._open(fresh=not self.append and not self._opened)
        if self.append and self.columns:
            # A resumed run redoes the steps after its checkpoint: their old rows go.
            self._rewrite_header(keep_through_step=self.trainer.step)

    @override
    def on_logs(self, step: int, logs: Logs) -> None:
        self.write(step, logs)
