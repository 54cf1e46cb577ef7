"""The callbacks a run of ``nnx-spmd-train`` trains with, built from its config."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

import jax
import ml_collections

# callbacks/ is mapped onto nnx_spmd_trainer.callbacks at install time; mypy reads the tree.
from nnx_spmd_trainer import Callback, callbacks  # type: ignore[attr-defined]
from nnx_spmd_trainer.app.console import say
from nnx_spmd_trainer.app.run_config import ConfigError


def versus_baseline(loss: float, baseline: float, baseline_name: str) -> str:
    """Where a held-out loss lies against the baseline it must beat, in words.

    >>> versus_baseline(6.1899, 5.9812, "unigram baseline")
    '0.2087 nats above the unigram baseline 5.9812 (worse)'
    >>> versus_baseline(4.5, 5.9812, "unigram baseline")
    '1.4812 nats below the unigram baseline 5.9812 (better)'
    """
    gap = loss - baseline
    if not math.isfinite(gap):
        return f"the {baseline_name} is {baseline:.4f}"
    if abs(gap) < 5e-5:  # 0.0000 as printed
        return f"level with the {baseline_name} {baseline:.4f}"
    side = "above" if gap > 0 else "below"
    return (
        f"{abs(gap):.4f} nats {side} the {baseline_name} {baseline:.4f} "
        f"({'worse' if gap > 0 else 'better'})"
    )


class BaselineReport(Callback):
    """Prints each held-out loss next to the baseline it must beat (process 0)."""

    def __init__(self, baseline: float, baseline_name: str) -> None:
        self.baseline = baseline
        self.baseline_name = baseline_name

    def on_test_end(self, logs: dict[str, float]) -> None:
        if "eval/loss" in logs and jax.process_index() == 0:
            gap = versus_baseline(logs["eval/loss"], self.baseline, self.baseline_name)
            say(f"step {self.trainer.step}: eval loss {logs['eval/loss']:.4f}, {gap}")


class SlowStepsNote(Callback):
    """One line, early, when the next metrics line is far off (slow steps, a long
    ``log_every_n_steps``): the pace of the first steps and when that line will come, so
    a quiet run is not taken for a hung one.

    Args:
      log_every_n_steps: the steps between metrics lines.
      after_s: the silence worth a line, in seconds.
      print_fn: where the line goes.
    """

    #: steps timed after the first (which compiles) before the pace is judged
    TIMED_STEPS = 3

    def __init__(
        self,
        log_every_n_steps: int,
        *,
        after_s: float = 30.0,
        print_fn: Callable[[str], None] = say,
    ) -> None:
        self.log_every_n_steps = log_every_n_steps
        self.after_s = after_s
        self.print_fn = print_fn
        self._first: tuple[int, float] | None = None
        self._done = False

    def on_train_begin(self, logs: dict[str, float]) -> None:
        self._first, self._done = None, False

    def on_train_batch_end(self, step: int, logs: dict[str, float]) -> None:
        if self._done:
            return
        now = time.perf_counter()
        if self._first is None:  # the first step compiled: time from its end on
            self._first = (step, now)
            return
        first_step, first_time = self._first
        if step - first_step < self.TIMED_STEPS:
            return
        self._done = True
        pace = (now - first_time) / (step - first_step)
        every = self.log_every_n_steps
        next_line = (step // every + 1) * every
        max_steps = self.trainer.progress.max_steps
        if max_steps is not None:
            next_line = min(next_line, max_steps)
        wait = pace * (next_line - step)
        if wait > self.after_s:
            self.print_fn(
                f"step {step}: {pace:.2f} s a step, so the next metrics line (every {every} "
                f"steps) comes at step {next_line}, in ~{_duration(wait)}; "
                "--config.log_every_n_steps sets how often"
            )


def _duration(seconds: float) -> str:
    """``"45 s"``, ``"3.2 min"``, ``"1.5 h"``."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


#: ``config.loggers``' names: each a writer of the run's logs, built from the config.
LOGGERS = ("tensorboard", "csv", "mlflow", "wandb")


def make_loggers(config: ml_collections.ConfigDict, workdir: Path) -> list[Callback]:
    """The writers ``config.loggers`` names (``"tensorboard,csv,mlflow"``); a ``ConfigError``
    names an unknown one, or one whose package is missing, before anything is written."""
    names = [name.strip() for name in str(config.get("loggers", "tensorboard,csv")).split(",")]
    unknown = [name for name in names if name not in LOGGERS]
    if unknown:
        raise ConfigError(
            f"config.loggers={config.loggers!r}: {', '.join(map(repr, unknown))} is not a "
            f"logger; use a comma-separated list of {', '.join(LOGGERS)}."
        )
    build = {
        "tensorboard": lambda: callbacks.TensorBoard(workdir / "tb"),
        "csv": lambda: callbacks.CSVLogger(workdir / "metrics.csv", append=config.resume),
        "mlflow": lambda: callbacks.MLflowLogger(
            config.get("mlflow_uri") or f"sqlite:///{workdir.absolute() / 'mlflow.db'}",
            run_name=workdir.name,
            artifact_location=str(workdir.absolute() / "mlflow-artifacts"),
        ),
        "wandb": lambda: callbacks.WandbLogger(
            config.get("wandb_project") or None, name=workdir.name, dir=workdir
        ),
    }
    try:
        loggers = [build[name]() for name in dict.fromkeys(names)]
    except ImportError as error:
        raise ConfigError(f"config.loggers={config.loggers!r}: {error}") from error
    store = workdir / "mlflow.db"
    if "mlflow" in names and not config.get("mlflow_uri") and not store.exists():
        say(  # MLflow's schema migrations run before the first step, silently
            f"mlflow: a new store {store}: MLflow sets up its tables first (~15 s, once); "
            f"browse it with mlflow ui --backend-store-uri sqlite:///{store.absolute()} "
            "(pip install 'nnx-spmd-trainer[mlflow-ui]')"
        )
    return loggers


def make_callbacks(config: ml_collections.ConfigDict, workdir: Path) -> list[Callback]:
    """Metrics every ``log_every_n_steps``, lr, NaN guard, checkpoints, progress, and the
    writers of ``config.loggers`` (TensorBoard and CSV by default)."""
    loggers = make_loggers(config, workdir)
    return [
        callbacks.MetricsLogger(config.log_every_n_steps),
        callbacks.LearningRateMonitor(),
        callbacks.TerminateOnNaN(check_every_n_steps=config.log_every_n_steps),
        callbacks.OrbaxCheckpoint(
            workdir / "checkpoints",
            save_every_n_steps=config.checkpoint_every_n_steps or None,
            save_every_n_seconds=config.get("save_every_n_seconds") or None,
            restore="latest" if config.resume else None,
            print_fn=say,
        ),
        callbacks.ProgressBar(plain=True),  # a line per log point in CI logs too
        SlowStepsNote(config.log_every_n_steps),
        *loggers,
    ]
