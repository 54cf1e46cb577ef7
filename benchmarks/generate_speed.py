"""Sampler speed: prefill and decode tokens per second, and the host's share of a decode step.

    python benchmarks/generate_speed.py [--devices 8] [--batches 1,8] [--prompt 32]
        [--new 32] [--repeats 5] [--out benchmarks/results] [--quick]

The model is the CLI's default job's GPT (``configs/default.py``: 2 layers, 128 wide,
8 heads, ff 512, 64 positions, the BPE's 1024 ids), laid out by that job's strategy
fitted to the devices (``fsdp=-1,model=2``: FSDP(4) x TensorParallel(2) on 8, one
device as is), with random weights: speed does not depend on them. Prompts of
``--prompt`` random tokens are continued greedily by ``--new`` tokens (no end token:
every step runs).

Each batch size is generated once to compile (not timed), then ``--repeats`` times;
the medians are reported, with the smallest and largest beside them. From each call's
``Sampler.last_timing`` (``generate.DecodeTiming``):

- prefill tokens/s: the prompts' tokens over the prefill program's wall time;
- decode tokens/s: the tokens the decode steps produced over the decode programs'
  wall time (each call to its result);
- outside the call: of the whole Python decode loop (the call, the wait, reading each
  step's tokens back, the stop checks), the part outside the compiled calls;
- outside the program: of the decode steps, the share when no compiled program runs
  on any device: the host's work, JAX's dispatch of the call's arguments (the
  weights' ~40 leaves, the cache) included. Read from a profile (``jax.profiler``)
  of one more ``generate``: the sampler's ``generate/decode_step`` annotations
  against the XLA CPU client's ``ThunkExecutor::Execute`` spans (the CPU only: on
  another backend the column reads ``nan``). The profiler's own cost is in it.

``--out`` appends the run's table to ``generate_speed.md`` and the run to the list in
``generate_speed_<devices>dev.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any


def _devices_from_argv() -> int:
    for i, arg in enumerate(sys.argv):
        if arg.startswith("--devices="):
            return int(arg.split("=", 1)[1])
        if arg == "--devices" and i + 1 < len(sys.argv):
            return int(sys.argv[i + 1])
    return 8


# The device count is fixed when JAX starts: set it before importing it.
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={_devices_from_argv()}")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from nnx_spmd_trainer import Sampler, Trainer  # noqa: E402
from nnx_spmd_trainer.app.models.gpt import GPT  # noqa: E402
from nnx_spmd_trainer.app.run_config import fit_to_devices, parse_strategy  # noqa: E402
from nnx_spmd_trainer.configs import default  # noqa: E402

VOCAB = 1024  # the default job's BPE (data.vocab_size), a multiple of 8 already


def default_trainer(quick: bool) -> tuple[Trainer, str]:
    """The default job's GPT, laid out by its strategy on this process's devices."""
    config = default.get_config()
    sizes = config.gpt
    spec, _ = fit_to_devices(config.strategy, jax.device_count())
    width = 32 if quick else sizes.embed_dim

    def factory(rngs: Any) -> GPT:
        return GPT(
            vocab_size=64 if quick else VOCAB, seq_len=sizes.seq_len, embed_dim=width,
            num_heads=sizes.num_heads, ff_dim=2 * width if quick else sizes.ff_dim,
            num_layers=sizes.num_layers, dropout_rate=0.0, rngs=rngs,
            scan_layers=sizes.scan_layers,
        )  # fmt: skip

    trainer = Trainer(
        factory, optax.sgd(0.1), strategy=parse_strategy(spec), loss_fn=lambda m, b: (0.0, {})
    )
    return trainer, spec


def _union_ns(intervals: list[tuple[int, int]]) -> int:
    """The nanoseconds covered by at least one of ``intervals``."""
    covered, reach = 0, None
    for begin, end in sorted(intervals):
        if reach is None or begin > reach:
            covered, reach = covered + end - begin, end
        elif end > reach:
            covered, reach = covered + end - reach, end
    return covered


def program_share(sampler: Sampler, prompts: list[list[int]], new: int) -> float:
    """The share of the sampler's decode steps (its ``generate/decode_step`` trace
    annotations) during which a compiled program runs on some device (the XLA CPU
    client's ``ThunkExecutor::Execute`` spans, any thread), from a profile of one
    ``generate`` (the Python tracer off); ``nan`` where the profile has neither."""
    folder = tempfile.mkdtemp(prefix="generate-speed-profile-")
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    jax.profiler.start_trace(folder, profiler_options=options)
    sampler.generate(prompts, max_new_tokens=new)
    jax.profiler.stop_trace()
    (path,) = Path(folder).rglob("*.xplane.pb")
    steps, runs = [], []
    for plane in jax.profiler.ProfileData.from_file(str(path)).planes:
        for line in plane.lines:
            for event in line.events:
                if event.name == "generate/decode_step":
                    steps.append((event.start_ns, event.end_ns))
                elif event.name == "ThunkExecutor::Execute":
                    runs.append((event.start_ns, event.end_ns))
    shutil.rmtree(folder, ignore_errors=True)
    if not steps or not runs:
        return float("nan")
    inside = sum(
        _union_ns([(max(a, begin), min(b, end)) for a, b in runs if a < end and b > begin])
        for begin, end in steps
    )
    return inside / sum(end - begin for begin, end in steps)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    trainer, spec = default_trainer(args.quick)
    sampler = Sampler(trainer.model, trainer.plan)
    rng = np.random.default_rng(0)
    vocab = 64 if args.quick else VOCAB
    rows = []
    for batch in args.batches:
        prompts = rng.integers(0, vocab, (batch, args.prompt)).tolist()
        sampler.generate(prompts, max_new_tokens=args.new)  # compiles
        runs = []
        for _ in range(args.repeats):
            out = sampler.generate(prompts, max_new_tokens=args.new)
            timing = sampler.last_timing
            assert timing is not None and timing.decode_steps == args.new - 1
            runs.append(
                {
                    "prefill_tokens_per_s": out.prefill_tokens_per_second,
                    "decode_tokens_per_s": out.decode_tokens_per_second,
                    "decode_step_ms": 1e3 * timing.decode_loop_seconds / timing.decode_steps,
                    "host_share": 1 - timing.decode_seconds / timing.decode_loop_seconds,
                }
            )
        row: dict[str, Any] = {"batch": batch, "rows": sampler.bucket(prompts, args.new)[0]}
        for key in runs[0]:
            values = sorted(r[key] for r in runs)
            row[key] = {"median": statistics.median(values), "min": values[0], "max": values[-1]}
        row["program_share"] = program_share(sampler, prompts, args.new)
        rows.append(row)
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(["python", "benchmarks/generate_speed.py", *sys.argv[1:]]),
        "backend": jax.default_backend(),
        "devices": jax.device_count(),
        "cpu_cores": os.cpu_count(),
        "load_average": os.getloadavg()[0],
        "strategy": spec,
        "prompt_tokens": args.prompt,
        "new_tokens": args.new,
        "repeats": args.repeats,
        "rows": rows,
    }


def table(result: dict[str, Any]) -> str:
    def cell(value: dict[str, float], scale: float = 1.0, digits: int = 0) -> str:
        median, low, high = (scale * value[k] for k in ("median", "min", "max"))
        return f"{median:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"

    header = ("batch (rows)", "prefill tokens/s", "decode tokens/s", "decode step ms",
              "outside the call %", "outside the program %")  # fmt: skip
    lines = [
        f"{result['date']}, {result['devices']} {result['backend']} device(s) on "
        f"{result['cpu_cores']} cores, strategy `{result['strategy']}`, load "
        f"{result['load_average']:.1f}: `{result['command']}`",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['batch']} ({row['rows']}) | {cell(row['prefill_tokens_per_s'])} "
            f"| {cell(row['decode_tokens_per_s'])} | {cell(row['decode_step_ms'], digits=2)} "
            f"| {cell(row['host_share'], 100, 1)} | {100 * (1 - row['program_share']):.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    parser.add_argument("--batches", default="1,8", help="prompts a call, comma-separated")
    parser.add_argument("--prompt", type=int, default=32, help="tokens a prompt")
    parser.add_argument("--new", type=int, default=32, help="tokens generated a prompt")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, help="append to generate_speed.md, write JSON here")
    parser.add_argument("--quick", action="store_true", help="tiny: the script runs, no more")
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.quick:
        args.prompt, args.new, args.repeats = 8, 4, 2
    result = measure(args)
    text = table(result)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"generate_speed_{result['devices']}dev.json"
        runs = json.loads(path.read_text()) if path.exists() else []
        path.write_text(json.dumps([*runs, result], indent=2) + "\n")
        with open(args.out / "generate_speed.md", "a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
