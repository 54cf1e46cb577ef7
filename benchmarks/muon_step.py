"""The sharded Muon step against ``optax.contrib.muon`` left to XLA, on 8 CPU devices.

    python benchmarks/muon_step.py [--layers 12] [--width 128] [--layout fsdp|fsdp-tp|dp]
        [--steps 4] [--rounds 5] [--out benchmarks/results] [--quick]

A GPT of ``--layers`` scanned layers (the shipped ``app.models.GPT``: each stacked leaf a
batch of ``--layers`` matrices) trained by two Trainers that differ only in the
optimizer: ``nnx_spmd_trainer.optim.muon`` (Newton-Schulz once per matrix, each matrix
moved whole to its owner by all-to-all) and ``optax.contrib.muon`` with the same settings
and the same dimension numbers, whose layout XLA chooses. They take turns in every round
(``floor.interleaved_rounds``: forward then backward, the order rotating); a ratio is the
median of per-round ratios. Beside the time, from the compiled programs: the optimizer's
update compiled alone (``optim.muon_report.optimizer_update``), its collectives' count and
bytes per device per step and its FLOPs per device, for both. ``--out`` appends the table
to ``muon_step.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Simulated CPU devices, and JAX kept on the CPU where no accelerator is (the tpu-plan
# extra's libtpu would start and print its warnings); a GPU or TPU machine is left as is.
from nnx_spmd_trainer.app.host_devices import simulate_host_devices  # noqa: E402

simulate_host_devices(8)
HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from floor import interleaved_rounds, paired_ratio  # noqa: E402

from nnx_spmd_trainer import FSDP, DataParallel, Hybrid, Plan, TensorParallel, Trainer  # noqa: E402
from nnx_spmd_trainer.app.models import GPT, gpt  # noqa: E402
from nnx_spmd_trainer.optim import matrix_dimension_numbers, muon, muon_report  # noqa: E402
from nnx_spmd_trainer.planner.plan_report import collectives  # noqa: E402

LAYOUTS: dict[str, Callable[[], Any]] = {
    "fsdp": lambda: FSDP(8, min_size=1),
    "fsdp-tp": lambda: Hybrid(FSDP(4, min_size=1), TensorParallel(2)),
    "dp": DataParallel,
}
SHARDED, XLA = "optim.muon (sharded)", "optax.contrib.muon (XLA's layout)"


def optimizers() -> dict[str, optax.GradientTransformation]:
    settings = dict(learning_rate=0.02, adam_learning_rate=3e-3)
    return {
        SHARDED: muon(**settings),
        XLA: optax.contrib.muon(**settings, muon_weight_dimension_numbers=matrix_dimension_numbers),
    }


def batches(args: argparse.Namespace) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    rows = rng.integers(0, args.vocab, size=(args.steps, args.batch, args.seq + 1), dtype=np.int32)
    return [{"inputs": r[:, :-1], "targets": r[:, 1:]} for r in rows]


def factory(args: argparse.Namespace) -> Callable[[Any], GPT]:
    def build(rngs: Any) -> GPT:
        return GPT(
            vocab_size=args.vocab,
            seq_len=args.seq,
            embed_dim=args.width,
            num_heads=4,
            ff_dim=4 * args.width,
            num_layers=args.layers,
            dropout_rate=0.0,
            rngs=rngs,
            scan_layers=True,
        )

    return build


def program(args: argparse.Namespace, tx: optax.GradientTransformation) -> dict[str, Any]:
    """The optimizer's update compiled alone: collectives and FLOPs per device."""
    plan = Plan(factory(args), tx, strategy=LAYOUTS[args.layout](), loss_fn=gpt.loss_fn)
    compiled = muon_report.optimizer_update(plan)
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list) else analysis
    found = {k: v for k, v in collectives(compiled.as_text()).items() if v["count"]}
    return {"flops": analysis["flops"], "collectives": found}


def loop(trainer: Trainer, data: list) -> Callable[[], float]:
    trainer.fit(data[:1], max_steps=1)

    def run() -> float:
        start = time.perf_counter()
        trainer.fit(data, max_steps=trainer.step + len(data))
        jax.block_until_ready(trainer.state)
        return (time.perf_counter() - start) / len(data)

    return run


def measure(args: argparse.Namespace) -> str:
    data = batches(args)
    programs = {name: program(args, tx) for name, tx in optimizers().items()}
    loops = {
        name: loop(
            Trainer(
                factory(args),
                tx,
                strategy=LAYOUTS[args.layout](),
                loss_fn=gpt.loss_fn,
                log_every_n_steps=args.steps,
            ),  # fmt: skip
            data,
        )
        for name, tx in optimizers().items()
    }
    rounds = interleaved_rounds(loops, args.rounds)
    ratio = paired_ratio(rounds[SHARDED], rounds[XLA])
    lines = [
        f"### {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}: "
        f"{args.layers} scanned layers x {args.width}, layout {args.layout}, "
        f"{args.rounds} rounds of {args.steps} steps",
        "",
        f"`python benchmarks/muon_step.py {' '.join(sys.argv[1:])}`; vocab {args.vocab}, "
        f"{args.seq} tokens, batch {args.batch}, {jax.device_count()} "
        f"{jax.devices()[0].platform} devices; load average "
        f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}.",
        "",
        "| optimizer | train step ms (median) | vs XLA's layout | optimizer update: "
        "FLOPs/device | its collectives (count, bytes/device) |",
        "|---|---|---|---|---|",
    ]
    for name in loops:
        found = programs[name]["collectives"]
        said = ", ".join(f"{k} {v['count']} ({v['bytes']:,} B)" for k, v in found.items())
        lines.append(
            f"| {name} | {statistics.median(rounds[name]) * 1e3:.1f} | "
            f"{ratio if name == SHARDED else 1.0:.3f} | {programs[name]['flops']:.3g} | "
            f"{said or 'none'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="fsdp")
    parser.add_argument("--steps", type=int, default=4, help="steps a round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, help="append the table to muon_step.md here")
    parser.add_argument("--quick", action="store_true", help="tiny: the script runs, no more")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.width, args.steps, args.rounds = 2, 32, 2, 1
    text = measure(args)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        with (args.out / "muon_step.md").open("a") as md:
            md.write("\n" + text)


if __name__ == "__main__":
    main()
