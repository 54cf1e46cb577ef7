"""The lines a job prints about its run, each made by one function from what the run
measured: what starts (``started_line``), a stop by SIGTERM (``preempted_line``), the
corpus bytes read (``corpus_reads_line``), the speed (``speed_line``) and where the time
went (``goodput_line``). ``job.run`` prints them."""

from __future__ import annotations

from pathlib import Path

import jax
import ml_collections
import numpy as np

# callbacks/ is mapped onto nnx_spmd_trainer.callbacks at install time; mypy reads the tree.
from nnx_spmd_trainer import Trainer, callbacks  # type: ignore[attr-defined]
from nnx_spmd_trainer.app import datasets
from nnx_spmd_trainer.data.corpus import TOKENS_FILE
from nnx_spmd_trainer.data.reads import bytes_read_in_process
from nnx_spmd_trainer.planner import compile_cache
from nnx_spmd_trainer.strategies import Strategy

__all__ = ["corpus_reads_line", "goodput_line", "preempted_line", "speed_line", "started_line"]


def started_line(
    config: ml_collections.ConfigDict,
    workdir: Path,
    trainer: Trainer,
    strategy: Strategy,
    why: str,
    splits: datasets.Splits,
) -> str:
    """What the run is, said as it starts: model, devices, mesh, layout, steps, baseline."""
    return (
        f"{config.model} on {trainer.mesh.size} {jax.devices()[0].platform} devices, "
        f"mesh {dict(trainer.mesh.shape)} ({strategy!r}, from strategy {config.strategy!r}"
        f"{': ' + why if why else ''}), {config.max_steps} steps of "
        f"{config.batch_size} examples; {splits.baseline_name} {splits.baseline:.4f}; "
        f"workdir {workdir}"
    )


def preempted_line(trainer: Trainer) -> str:
    """What a SIGTERM left behind: the step saved, or (before any step) the checkpoints as
    they were."""
    checkpoint = next(c for c in trainer.callbacks if isinstance(c, callbacks.OrbaxCheckpoint))
    if checkpoint.stopped_before_a_step:
        return (
            f"stopped by SIGTERM before any step (at step {trainer.step}): nothing trained, "
            "nothing saved; run the same command to continue"
        )
    return f"stopped by SIGTERM after step {trainer.step}, saved; run the same command to continue"


def corpus_reads_line(before: dict[str, int]) -> str | None:
    """What this process read from each corpus since ``before`` (``bytes_read_in_process``),
    against the corpus's token bytes; ``None``: no corpus was read."""
    read = {f: n - before.get(f, 0) for f, n in bytes_read_in_process().items()}
    read = {folder: n for folder, n in read.items() if n}
    if not read:
        return None
    parts = ", ".join(
        f"{folder}: {n} of its {(Path(folder) / TOKENS_FILE).stat().st_size}"
        for folder, n in read.items()
    )
    return (
        f"data: process {jax.process_index()} of {jax.process_count()} read "
        f"{sum(read.values())} bytes of corpus tokens ({parts})"
    )


def speed_line(history: dict[str, list[float]], note: str | None = None) -> str | None:
    """One line: the median over the log points of the tokens per second, the FLOP/s per
    device (the compiled step's own count) and the MFU, or ``note``, why there is none;
    ``None`` where nothing was measured.

    >>> speed_line({"perf/tokens_per_s": [900.0, 1000.0, 1100.0],
    ...             "perf/flops_per_s_per_device": [2e12, 3e12, 4e12], "perf/mfu": [0.2, 0.3, 0.4]})
    'speed (median of 3 log points): 1,000 tokens/s, 3 TFLOP/s per device, MFU 30.0%'
    """
    tokens = history.get("perf/tokens_per_s", [])
    flops = history.get("perf/flops_per_s_per_device", [])
    mfu = history.get("perf/mfu", [])
    if not tokens and not flops:
        return None
    parts = [f"{float(np.median(tokens)):,.0f} tokens/s"] if tokens else []
    if flops:
        parts.append(f"{float(np.median(flops)) / 1e12:.3g} TFLOP/s per device")
    if mfu:
        parts.append(f"MFU {100 * float(np.median(mfu)):.1f}%")
    elif note:
        parts.append(note)
    points = max(len(tokens), len(flops))
    plural = "s" if points != 1 else ""
    return f"speed (median of {points} log point{plural}): " + ", ".join(parts)


def goodput_line(goodput: dict[str, float], cache: compile_cache.CacheCounts | None = None) -> str:
    """One line: where the wall time of ``fit`` went, in seconds and shares, and what the
    persistent compilation cache served of the compiles (``cache``: its hits and misses
    over the ``fit``; ``None``: it is off).

    >>> parts = {"compile": 3.0, "step": 6.0, "other": 1.0}
    >>> goodput = {f"goodput/{k}_s": v for k, v in parts.items()} | {"goodput/wall_s": 10.0}
    >>> line = goodput_line(goodput, compile_cache.CacheCounts(hits=5, misses=1))
    >>> for part in line.split(" = "):
    ...     print(part)
    time: 10.0 s of fit, compile 3.0 s (compile cache: 5 hits, 1 miss)
    compile 30.0%, step 60.0%, other 10.0%
    >>> print(goodput_line(goodput, None).partition(" = ")[0])
    time: 10.0 s of fit, compile 3.0 s (compile cache off)
    """
    wall = goodput["goodput/wall_s"]
    parts = [
        (key.removeprefix("goodput/").removesuffix("_s"), value)
        for key, value in goodput.items()
        if key != "goodput/wall_s"
    ]
    shares = ", ".join(f"{name} {100 * value / wall:.1f}%" for name, value in parts if wall > 0)
    served = f"compile cache: {cache}" if cache is not None else "compile cache off"
    compiling = f"compile {goodput.get('goodput/compile_s', 0.0):.1f} s ({served})"
    return f"time: {wall:.1f} s of fit, {compiling} = {shares}"
