"""Where a GPT-2 small step spends its GPU time: the Trainer against the hand-written limit.

    python benchmarks/gpu_profile.py [--steps 5] [--batch 16] [--trace-dir DIR]

Traces a few steps of each loop of ``gpu.py`` (after warm-up) with
``jax.profiler.trace(create_perfetto_trace=True)`` and sums the device kernels'
time per step: by kind (matmul, attention, fusion, copy, other) and the longest
kernels. The difference between the two loops is what the Trainer's model and
step cost beyond the limit.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from floor import PREFIX  # noqa: E402
from gpu import GPT2_SMALL, TINY, gpt_workload, handwritten_limit  # noqa: E402
from run_all import floor_loops, trainer_loop  # noqa: E402

from nnx_spmd_trainer import DataParallel  # noqa: E402

KINDS = [
    ("matmul", re.compile(r"gemm|cublas|cutlass|matmul|sm90_xmma|nvjet", re.I)),
    ("attention", re.compile(r"cudnn|flash|fmha|attention|sdpa", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy", re.I)),
    ("fusion", re.compile(r"fusion|loop_|input_|reduce|transpose|convert", re.I)),
]


def device_kernels(trace_dir: Path) -> list[tuple[str, float]]:
    """(name, microseconds) of every event on a GPU stream in the perfetto trace."""
    path = next(trace_dir.rglob("*.trace.json.gz"))
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    gpu_pids = {
        e["pid"]
        for e in events
        if e.get("ph") == "M"
        and e.get("name") == "process_name"
        and "gpu" in str(e.get("args", {}).get("name", "")).lower()
    }
    return [
        (e["name"], float(e["dur"]))
        for e in events
        if e.get("ph") == "X" and e.get("pid") in gpu_pids and "dur" in e
    ]


def kind(name: str) -> str:
    return next((k for k, pattern in KINDS if pattern.search(name)), "other")


def profile(name: str, run: Callable[[], float], steps: int, root: Path) -> dict[str, Any]:
    """``steps``: the steps one ``run()`` dispatches."""
    run()  # warm
    trace_dir = root / re.sub(r"\W+", "_", name)
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        seconds = run()
    kernels = device_kernels(trace_dir)
    by_kind: dict[str, float] = collections.Counter()
    by_name: dict[str, float] = collections.Counter()
    for kernel, micros in kernels:
        by_kind[kind(kernel)] += micros / steps / 1e3
        by_name[kernel] += micros / steps / 1e3
    return {
        "loop": name,
        "wall_ms_per_step": seconds * 1e3,
        "kernel_ms_per_step": sum(by_kind.values()),
        "kernels_per_step": len(kernels) / steps,
        "by_kind_ms": dict(by_kind),
        "top_ms": by_name.most_common(12),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=GPT2_SMALL["batch"])
    parser.add_argument("--trace-dir", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks the script runs")
    args = parser.parse_args()
    size = {**(TINY if args.quick else GPT2_SMALL), "batch": args.batch}
    bf16 = gpt_workload(size, jnp.bfloat16, args.steps)
    loops = {
        "hand-written limit": handwritten_limit(size, args.steps),
        "jax.jit floor, shipped GPT": floor_loops(bf16, DataParallel())[
            f"{PREFIX} (donating, placed inline)"
        ],
        "Trainer.fit, shipped GPT": trainer_loop(bf16, DataParallel()),
    }
    # The two hand-written loops dispatch one untimed step before their timed ones.
    dispatched = {name: args.steps + (name != "Trainer.fit, shipped GPT") for name in loops}
    root = args.trace_dir or Path(tempfile.mkdtemp())
    for name, run in loops.items():
        found = profile(name, run, dispatched[name], root)
        print(
            f"\n== {name}: wall {found['wall_ms_per_step']:.2f} ms/step, kernels "
            f"{found['kernel_ms_per_step']:.2f} ms/step ({found['kernels_per_step']:.0f} kernels)"
        )
        print(
            "  by kind: "
            + ", ".join(f"{k} {v:.2f}" for k, v in sorted(found["by_kind_ms"].items()))
        )
        for kernel, ms in found["top_ms"]:
            print(f"  {ms:7.3f} ms  {kernel[:110]}")


if __name__ == "__main__":
    main()
