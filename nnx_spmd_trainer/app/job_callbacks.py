"""The callbacks a run of ``nnx-spmd-train`` trains with, built from its config."""

from __future__ import annotations

from pathlib import Path

import jax
import ml_collections

# callbacks/ is mapped onto nnx_spmd_trainer.callbacks at install time; mypy reads the tree.
from nnx_spmd_trainer import Callback, callbacks  # type: ignore[attr-defined]
from nnx_spmd_trainer.app.console import say


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


def make_callbacks(config: ml_collections.ConfigDict, workdir: Path) -> list[Callback]:
    """Metrics every ``log_every_n_steps``, lr, NaN guard, checkpoints, TensorBoard, progress,
    CSV."""
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
        callbacks.TensorBoard(workdir / "tb"),
        callbacks.ProgressBar(plain=True),  # a line per log point in CI logs too
        callbacks.CSVLogger(workdir / "metrics.csv", append=config.resume),
    ]
