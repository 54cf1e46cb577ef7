"""``nnx-spmd-train evaluate``: a workdir's checkpoint evaluated on its held-out data, nothing
trained and nothing written.

    nnx-spmd-train evaluate runs/default                 # the latest checkpoint
    nnx-spmd-train evaluate runs/default --step 200 --max_eval_batches 0   # all batches

The run's own record says what to build: ``WORKDIR/config.json`` (the config it
trained with), the tokenizer it saved, and ``WORKDIR/checkpoints``, whose model is read
into the layout the config names (``loader.load_run``: any run, DPO's and GRPO's too).
It prints the eval metrics of that step, the held-out loss against the task's
baseline and, for text, bits per byte; no speed or timing line of the run that
wrote the checkpoint. A workdir without a config or a checkpoint is one line on
stderr and exit status 2, as every refusal of ``nnx-spmd-train``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import ml_collections

# callbacks/ is mapped onto nnx_spmd_trainer.callbacks at install time; mypy reads the tree.
from nnx_spmd_trainer.app import loader, tasks
from nnx_spmd_trainer.app.command_line import fail
from nnx_spmd_trainer.app.console import say
from nnx_spmd_trainer.app.host_devices import simulate_host_devices
from nnx_spmd_trainer.app.job_callbacks import versus_baseline

__all__ = ["evaluate_workdir", "main", "parser"]


def parser() -> argparse.ArgumentParser:
    """The command's arguments."""
    commands = argparse.ArgumentParser(
        prog="nnx-spmd-train evaluate",
        description="Evaluate a workdir's checkpoint on its held-out data (trains nothing, "
        "writes nothing).",
    )
    commands.add_argument("workdir", help="the --workdir of a run (its config.json, checkpoints/)")
    commands.add_argument(
        "--step", type=int, default=None, help="the checkpoint step (default: the latest)"
    )
    commands.add_argument(
        "--max_eval_batches",
        type=int,
        default=None,
        help="held-out batches to evaluate (default: the run's config; 0: all)",
    )
    return commands


def run_config(workdir: Path, max_eval_batches: int | None) -> ml_collections.ConfigDict:
    """The config ``workdir``'s run trained with (``config.json``), or exit 2 naming why."""
    try:
        config = loader.run_config(workdir)
    except tasks.ConfigError as error:
        fail(f"evaluate: {error}")
    if max_eval_batches is not None:
        config.max_eval_batches = max_eval_batches
    return config


def main(argv: Sequence[str] | None = None) -> int:
    """Evaluates the checkpoint and prints its metrics; returns 0, or exits 2 with one line."""
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    workdir = Path(args.workdir)
    checkpoints = workdir / "checkpoints"
    if not loader.saved_steps(workdir):
        fail(
            f"evaluate: no checkpoint in {checkpoints}: train first (nnx-spmd-train "
            f"--workdir={workdir}), or name the workdir of a run that saved one."
        )
    config = run_config(workdir, args.max_eval_batches)
    simulate_host_devices(config.get("num_devices", 8))  # before JAX starts its backend
    try:
        evaluate_workdir(config, workdir, step=args.step)
    except loader.NOT_READ as error:
        fail(f"evaluate: {error}")
    return 0


def evaluate_workdir(
    config: ml_collections.ConfigDict, workdir: Path, *, step: int | None = None
) -> dict[str, float]:
    """The eval metrics of ``workdir``'s checkpoint ``step`` (``None``: the latest), built
    as the run was from ``config`` (``loader.load_run``: its model read alone, whatever
    trainer wrote it) and read only; prints them (process 0)."""
    run = loader.load_run(workdir, step="latest" if step is None else step, config=config)
    logs = run.trainer.evaluate(run.splits.eval)
    splits, loss = run.splits, float(logs["loss"])
    gap = versus_baseline(loss, splits.baseline, splits.baseline_name)
    say(f"step {run.step}: eval loss {loss:.4f}, {gap}")
    metrics = " ".join(f"eval/{k}={float(v):.4g}" for k, v in sorted(logs.items()))
    say(f"evaluated step {run.step} of {workdir}: {metrics}")
    if bits := run.splits.bits_per_byte_line(float(logs["loss"])):
        say(bits)
    return {f"eval/{k}": float(v) for k, v in logs.items()}


if __name__ == "__main__":
    sys.exit(main())
