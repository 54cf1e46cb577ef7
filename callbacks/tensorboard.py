"""TensorBoard: scalars, run config, sharding table, histograms and hparams (tensorboardX)."""

from __future__ import annotations

import dataclasses
import math
import os
import time
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx
from tensorboardX import SummaryWriter
from tensorboardX.summary import hparams as hparams_summary
from typing_extensions import override

from nnx_spmd_trainer import Callback, Logs, Trainer, path_str, sharding_table
from nnx_spmd_trainer.adapters import tensorboardx_private

from .plan_text import plan_report_for
from .throughput import Throughput, batch_size_and_tokens


def event_file_suffix(kind: str = "") -> str:
    """A suffix that makes this writer's event file name its own and later than any before.

    tensorboardX names a file by the second it opens and the host, and opens it for
    writing: a second writer in the same second (a run resumed at once, a test) would
    truncate the first's file. Nanoseconds, zero-padded, keep the names distinct and in
    opening order, the order TensorBoard's reader replays a directory in.
    """
    return f".{time.time_ns():020d}.{os.getpid()}{kind}"


def flatten_config(config: Any) -> dict[str, Any]:
    """A run config (ml_collections ConfigDict, dataclass, dict, None) as ``{"a.b": value}``."""
    if config is None:
        return {}
    if hasattr(config, "to_dict"):  # ml_collections.ConfigDict / FrozenConfigDict
        config = config.to_dict()
    elif dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    if not isinstance(config, Mapping):
        return {"config": config}
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping) or hasattr(value, "to_dict"):
            flat.update({f"{key}.{k}": v for k, v in flatten_config(value).items()})
        else:
            flat[str(key)] = value
    return flat


def _markdown(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        lines.append("| " + " | ".join(str(cell).replace("|", "\\|") for cell in row) + " |")
    return "\n".join(lines)


def sharding_text(trainer: Trainer) -> tuple[str, int]:
    """The strategy, the mesh and one row per state leaf (parameters and optimizer state),
    as Markdown; and the total bytes a device holds."""
    rows = sharding_table(trainer.state)
    total = sum(row["bytes_per_device"] for row in rows)
    header = f"strategy: `{trainer.strategy!r}`, mesh: `{dict(trainer.mesh.shape)}`\n\n"
    table = _markdown(
        ["state leaf", "shape", "dtype", "spec", "bytes/device"],
        [[r["path"], r["shape"], r["dtype"], r["spec"], r["bytes_per_device"]] for r in rows]
        + [["**total per device**", "", "", "", total]],
    )
    return header + table, total


def _code(text: str) -> str:
    """Preformatted text for TensorBoard's Markdown: each line indented four spaces."""
    return "\n".join("    " + line for line in text.splitlines())


def _hparam_value(value: Any) -> bool | int | float | str:
    return value if isinstance(value, bool | int | float | str) else str(value)


class TensorBoard(Callback):
    """Writes what a run needs to be read later in TensorBoard, on process 0 only.

    * scalars: every value that reaches ``logs`` (``train/...``, ``eval/...``,
      ``lr``, the ``epoch``, the global norms ``train/grad_norm``,
      ``train/update_norm`` and ``train/param_norm``, ``perf/compile_time_s``
      and, where the backend reports it, ``perf/device_memory_gb``), at the
      global step it belongs to;
    * ``perf/step_time_s``, ``perf/steps_per_s``, ``perf/examples_per_s`` and,
      for token batches, ``perf/tokens_per_s`` (the run's own where its logs carry it,
      with ``perf/flops_per_s_per_device`` and ``perf/mfu``) at each log point of training
      metrics: host wall time between log points, evaluation and compile time
      excluded, never a per-step sync.
      The batch size comes from ``examples_per_step`` / ``tokens_per_step``
      or the last step's batch shapes (``self.step_record.batch_shapes``, as handed);
      without either, only the step rates are written;
    * at the start: the run config (``trainer.config``) and the sharding
      table of the whole state, parameters and optimizer state (path, shape,
      spec, bytes per device, and the total each device holds) as text, and
      the parameter count as ``model/parameters``; with ``strategy="auto"``,
      the ranking of the layouts (``layout``); and the plan report of the train
      step (``plan``: the mesh, each leaf's layout, the compiled memory and
      collectives; ``PlanReport``), from the ``auto`` choice, else at the first
      step from its batch's shapes (the step is compiled by then: a cache hit);
    * every ``histogram_every_n_steps`` steps: histograms of the parameters;
    * at the end: hparams (the flattened config, and the run's scalars as
      their metrics) in the run itself, so TensorBoard's HParams tab lists the
      run once; then the writer is closed. It is closed too (without hparams)
      when ``fit`` fails.

    Example::

        Trainer(..., config=config,
                callbacks=[MetricsLogger(50), LearningRateMonitor(), TensorBoard("runs/a")])
        # tensorboard --logdir runs
    """

    def __init__(
        self,
        logdir: str | os.PathLike[str],
        *,
        histogram_every_n_steps: int | None = None,
        examples_per_step: int | None = None,
        tokens_per_step: int | None = None,
        write_config: bool = True,
        write_sharding: bool = True,
        write_hparams: bool = True,
        write_plan: bool = True,
        flush_secs: int = 30,
    ) -> None:
        self.logdir = os.fspath(logdir)
        self.histogram_every_n_steps = histogram_every_n_steps
        self.examples_per_step = examples_per_step
        self.tokens_per_step = tokens_per_step
        self.write_config = write_config
        self.write_sharding = write_sharding
        self.write_hparams = write_hparams
        self.write_plan = write_plan
        self._plan_due = False
        self.flush_secs = flush_secs
        self._writer: SummaryWriter | None = None
        self._timer = Throughput()
        self._compile_seconds = 0.0
        self._last: dict[str, float] = {}
        self._purge_step: int | None = None

    @property
    def writer(self) -> SummaryWriter | None:
        """The tensorboardX writer on process 0 (opened on first use), ``None`` elsewhere."""
        if jax.process_index() != 0:
            return None
        if self._writer is None:
            # purge_step: TensorBoard hides what an earlier, killed run logged past the
            # step this run resumed from, so a curve has no duplicate points (on_train_begin).
            self._writer = SummaryWriter(
                self.logdir,
                flush_secs=self.flush_secs,
                purge_step=self._purge_step,
                filename_suffix=event_file_suffix(),
            )
        return self._writer

    # -- what gets written -------------------------------------------------------
    def write_scalars(self, logs: Logs, step: int) -> None:
        if (writer := self.writer) is None:
            return
        for key, value in logs.items():
            writer.add_scalar(key, value, step)
            self._last[key] = value

    def _write_throughput(self, logs: Logs, step: int) -> None:
        if not any(key.startswith("train/") for key in logs):
            return
        self._timer.exclude(self._compile_seconds)  # a compile is not a step
        self._compile_seconds = 0.0
        seconds = self._timer.seconds_per_step(step)
        if seconds is None or seconds <= 0 or (writer := self.writer) is None:
            return
        writer.add_scalar("perf/step_time_s", seconds, step)
        writer.add_scalar("perf/steps_per_s", 1.0 / seconds, step)
        examples, tokens = self.examples_per_step, self.tokens_per_step
        record = self.step_record
        if examples is None and record is not None:
            examples, tokens = batch_size_and_tokens(record.batch_shapes)
        if examples is not None:
            writer.add_scalar("perf/examples_per_s", examples / seconds, step)
        if tokens is not None and "perf/tokens_per_s" not in logs:  # else the run's own, above
            writer.add_scalar("perf/tokens_per_s", tokens / seconds, step)

    def _write_config(self, writer: SummaryWriter, step: int) -> None:
        flat = flatten_config(self.trainer.config)
        rows = [[key, repr(value)] for key, value in sorted(flat.items())]
        text = _markdown(["key", "value"], rows) if rows else "(no config)"
        writer.add_text("config", text, step)

    def _write_sharding(self, writer: SummaryWriter, step: int) -> None:
        text, _ = sharding_text(self.trainer)
        writer.add_text("sharding", text, step)

    def _write_layout(self, writer: SummaryWriter, step: int) -> None:
        """The ``auto`` ranking and the chosen plan's report, where the trainer chose."""
        choice = getattr(self.trainer, "layout_choice", None)
        if choice is not None:
            writer.add_text("layout", choice.markdown(), step)
        if not self.write_plan:
            return
        if choice is not None:
            writer.add_text("plan", _code(str(choice.report)), step)
        else:
            self._plan_due = True  # at the first step: its batch gives the shapes

    def _write_plan_report(self, step: int) -> None:
        self._plan_due = False
        if (writer := self.writer) is None:
            return
        report = plan_report_for(self.step_record, self.trainer, "TensorBoard")
        if report is None:
            return
        writer.add_text("plan", _code(str(report)), step)

    def write_histograms(self, step: int) -> None:
        if (writer := self.writer) is None:
            return
        params = nnx.state(self.trainer.model, nnx.Param)
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
            if not leaf.is_fully_addressable:
                # Gathering needs every process to join; process 0 alone cannot.
                warnings.warn(
                    f"TensorBoard: no histogram for {path_str(path)} (multi-process).",
                    stacklevel=2,
                )
                continue
            writer.add_histogram(f"params/{path_str(path)}", np.asarray(leaf, np.float32), step)

    def _write_hparams(self, writer: SummaryWriter) -> None:
        hparams = {k: _hparam_value(v) for k, v in flatten_config(self.trainer.config).items()}
        metrics = {k: v for k, v in self._last.items() if math.isfinite(v)}
        if hparams and metrics:
            # Into this run's own event file (add_hparams would start a second run that
            # repeats the scalars); the metrics are the scalars already written here.
            file_writer = tensorboardx_private.event_file_writer(writer)
            for summary in hparams_summary(hparams, metrics):
                file_writer.add_summary(summary, self.trainer.step)

    # -- hooks -------------------------------------------------------------------------
    @override
    def on_train_begin(self, logs: Logs) -> None:
        self._timer.start(self.trainer.step)
        self._compile_seconds = 0.0  # compiling in the steps since the last log point
        # Every run marks its start (a SessionLog.START at purge_step): TensorBoard's own
        # reader (plugin_event_accumulator) takes the first START of a directory for the
        # run's beginning and purges only at a later one, so a fresh run writes one at 0
        # and a resumed run's START at the step after its checkpoint then hides what a
        # killed attempt logged past that step.
        self._purge_step = self.trainer.step + 1 if self.trainer.step else 0
        if (writer := self.writer) is None:
            return
        if self.write_config:
            self._write_config(writer, self.trainer.step)
        if self.write_sharding:
            self._write_sharding(writer, self.trainer.step)
        self._write_layout(writer, self.trainer.step)
        parameters = sum(x.size for x in jax.tree.leaves(nnx.state(self.trainer.model, nnx.Param)))
        writer.add_scalar("model/parameters", parameters, self.trainer.step)
        writer.flush()

    @override
    def on_train_batch_end(self, step: int, logs: Logs) -> None:
        if (record := self.step_record) is not None:
            self._compile_seconds += record.compile_s
        if self._plan_due:
            self._write_plan_report(step)
        if self.histogram_every_n_steps and step % self.histogram_every_n_steps == 0:
            self.write_histograms(step)

    @override
    def on_test_begin(self, logs: Logs) -> None:
        self._timer.pause()

    @override
    def on_test_end(self, logs: Logs) -> None:
        self._timer.resume()

    @override
    def on_logs(self, step: int, logs: Logs) -> None:
        self.write_scalars(logs, step)
        self._write_throughput(logs, step)
        if any(key.startswith("eval/") for key in logs) and self._writer is not None:
            self._writer.flush()  # evaluations are rare and worth seeing at once

    @override
    def on_fit_end(self, logs: Logs) -> None:
        # After the final values reached on_logs: the hparams summary can hold them.
        if self.write_hparams and (writer := self.writer) is not None:
            self._write_hparams(writer)
        self.close()

    @override
    def on_exception(self, error: BaseException) -> None:
        self.close()

    def close(self) -> None:
        """Flushes and closes the writer; a later write opens a new event file."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
