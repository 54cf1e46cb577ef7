"""The callbacks a run of ``nnx-spmd-train`` trains with, built from its config."""

from __future__ import annotations

import math
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
    if gap == 0:
        return f"equal to the {baseline_name} {baseline:.4f}"
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
            say(
                f"step {self.trainer.step}: eval loss {logs['eval/loss']:.4f} "
                f"({self.baseline_name} {self.baseline:.4f})"
            )


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
        return [build[name]() for name in dict.fromkeys(names)]
    except ImportError as error:
        raise ConfigError(f"config.loggers={config.loggers!r}: {error}") from error


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
        *loggers,
    ]
