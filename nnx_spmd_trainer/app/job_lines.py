"""The lines a job prints about its run, each made by one function from what the run
measured: what starts (``started_line``), a stop by SIGTERM (``preempted_line``), the
corpus bytes read (``corpus_reads_line``), the speed (``speed_line``) and where the time
went (``goodput_line``). ``job.run`` prints them."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import ml_collections
import numpy as np

# callbacks/ is mapped onto nnx_spmd_trainer.callbacks at install time; mypy reads the tree.
from nnx_spmd_trainer import Strategy, Trainer, callbacks, compile_cache  # type: ignore[attr-defined]
from nnx_spmd_trainer.app import datasets
from nnx_spmd_trainer.data import TOKENS_FILE, bytes_read_in_process

__all__ = [
    "corpus_reads_line",
    "goodput_line",
    "preempted_line",
    "sizes_line",
    "speed_line",
    "started_line",
]


def started_line(
    config: ml_collections.ConfigDict,
    workdir: Path,
    trainer: Trainer,
    strategy: Strategy,
    why: str,
    splits: datasets.Splits,
) -> str:
    """What the run is, said as it starts: model, devices, mesh, layout, steps, baseline;
    then the data's lines (``Splits.summary``: the corpus sizes, the mixture, a chat file's
    conversations kept, cut and skipped), as a dry run prints them, and that the step
    compiles first."""
    line = (
        f"{config.model} on {trainer.mesh.size} {jax.devices()[0].platform} devices, "
        f"mesh {dict(trainer.mesh.shape)} ({strategy!r}, from strategy {config.strategy!r}"
        f"{': ' + why if why else ''}), {config.max_steps} steps of "
        f"{config.batch_size} examples; {splits.baseline_name} {splits.baseline:.4f}; "
        f"workdir {workdir}"
    )
    # the first step's line waits for the compiler (tens of seconds on a CPU): said, not silent
    compiling = "compiling the train step first (a rerun may read it from the compile cache)"
    return "\n".join((line, *splits.summary, compiling))


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


#: Integer keys of a model's config that set no parameter's shape.
_NOT_SIZES = frozenset({"chunked_loss", "moe_top_k", "seed"})


def sizes_line(config: ml_collections.ConfigDict, step: Path) -> str:
    """What a refusal over a shape says to set: the size keys of ``config`` (its model's
    ``config.<model>.*`` integers, and ``config.data.vocab_size``, the BPE's, which sizes
    the embedding when ``vocab_size`` is 0) whose values differ from those in the
    ``config.json`` of the run that wrote ``step`` (``<workdir>/checkpoints/<step>``).

    >>> import json, tempfile
    >>> run = Path(tempfile.mkdtemp())
    >>> earlier = {"model": "gpt", "gpt": {"embed_dim": 128, "seq_len": 64},
    ...            "data": {"vocab_size": 1024}}
    >>> _ = (run / "config.json").write_text(json.dumps(earlier))
    >>> config = ml_collections.ConfigDict(
    ...     {"model": "gpt", "gpt": {"embed_dim": 32, "seq_len": 64}, "data": {"vocab_size": 300}})
    >>> print(sizes_line(config, run / "checkpoints" / "40"))
    The sizes are set by config.gpt.embed_dim=32 (that run's: 128), config.data.vocab_size=300 \
(that run's: 1024): pass --config.gpt.embed_dim=128 --config.data.vocab_size=1024.
    """
    model = str(config.get("model", ""))
    workdir = step.parent.parent if step.parent.name == "checkpoints" else step.parent
    ours = {f"{model}.{k}": v for k, v in (config.get(model) or {}).items()}
    ours["data.vocab_size"] = (config.get("data") or {}).get("vocab_size")
    ours = {k: v for k, v in ours.items() if _is_size(k, v)}
    keys = ", ".join(f"config.{k}" for k in ours)
    try:
        before = json.loads((workdir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return f"This model's sizes are set by {keys}: give that run's values."
    theirs = {f"{model}.{k}": v for k, v in (before.get(model) or {}).items()}
    theirs["data.vocab_size"] = (before.get("data") or {}).get("vocab_size")
    differ = [k for k in ours if k in theirs and _is_size(k, theirs[k]) and theirs[k] != ours[k]]
    if before.get("model") != model or not differ:
        return (
            f"This model's sizes are set by {keys} (the run that wrote it, {workdir}, is "
            f"config.model={before.get('model')!r} with {len(differ)} of them other)."
        )
    said = ", ".join(f"config.{k}={ours[k]} (that run's: {theirs[k]})" for k in differ)
    flags = " ".join(f"--config.{k}={theirs[k]}" for k in differ)
    return f"The sizes are set by {said}: pass {flags}."


def _is_size(key: str, value: object) -> bool:
    return (
        isinstance(value, int)
        and not isinstance(value, bool)
        and (key.rsplit(".", 1)[-1] not in _NOT_SIZES)
    )
