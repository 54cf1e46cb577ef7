"""The train step's compile time as a GPT deepens: unrolled blocks against scanned ones.

A small GPT (width 64, 4 heads, sequence 64, vocabulary 128) under
Hybrid(FSDP(4), TensorParallel(2)) on 8 simulated CPU devices, AdamW, batch 8.
For each depth, ``Plan.lower(batch)`` (trace + lowering) and ``.compile()`` (XLA)
of the train step, timed for ``GPT(scan_layers=False)`` and ``GPT(scan_layers=True)``
side by side: rounds interleave the two forms and every depth, so a busy machine
slows both alike; the table shows each form's median over the rounds and the ratio
scanned / unrolled. No array is built and no step runs.

    python benchmarks/compile_depth.py [--layers 4,8,16,32] [--rounds 3] [--quick]
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from nnx_spmd_trainer import FSDP, Hybrid, Plan, TensorParallel  # noqa: E402
from nnx_spmd_trainer.app.models import GPT, gpt  # noqa: E402

ROWS, SEQ, VOCAB = 8, 64, 128


def compile_seconds(layers: int, scan: bool, width: int) -> tuple[float, float]:
    """(lower, compile) seconds of the train step of a fresh plan."""

    def model(rngs):
        return GPT(
            vocab_size=VOCAB, seq_len=SEQ, embed_dim=width, num_heads=4, ff_dim=4 * width,
            num_layers=layers, dropout_rate=0.0, rngs=rngs, scan_layers=scan,
        )  # fmt: skip

    plan = Plan(
        model,
        optax.adamw(1e-3),
        strategy=Hybrid(FSDP(4), TensorParallel(2)),
        loss_fn=gpt.loss_fn,
    )
    batch = {k: jax.ShapeDtypeStruct((ROWS, SEQ), jnp.int32) for k in ("inputs", "targets")}
    start = time.perf_counter()
    lowered = plan.lower(batch)
    lowered_at = time.perf_counter()
    lowered.compile()
    return lowered_at - start, time.perf_counter() - lowered_at


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="4,8,16,32", help="comma-separated depths")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="depths 1 and 2, one round")
    args = parser.parse_args()
    depths = [1, 2] if args.quick else [int(n) for n in args.layers.split(",")]
    rounds = 1 if args.quick else args.rounds
    print(
        f"GPT width {args.width}, sequence {SEQ}, batch {ROWS}, AdamW, "
        f"Hybrid(FSDP(4), TensorParallel(2)) on {len(jax.devices())} "
        f"{jax.devices()[0].platform} devices; {rounds} interleaved round(s), medians"
    )
    times: dict[tuple[int, bool], list[tuple[float, float]]] = {}
    for _ in range(rounds):
        for layers in depths:
            for scan in (False, True):
                times.setdefault((layers, scan), []).append(
                    compile_seconds(layers, scan, args.width)
                )

    def median(layers: int, scan: bool, part: int | None = None) -> float:
        runs = times[layers, scan]
        return statistics.median(sum(r) if part is None else r[part] for r in runs)

    print()
    print(
        "| layers | unrolled lower + compile (s) | scanned lower + compile (s) "
        "| scanned / unrolled |"
    )
    print("|---:|---:|---:|---:|")
    for layers in depths:
        unrolled, scanned = median(layers, False), median(layers, True)
        parts = [
            f"{median(layers, scan, 0):.1f} + {median(layers, scan, 1):.1f} = {total:.1f}"
            for scan, total in ((False, unrolled), (True, scanned))
        ]
        print(f"| {layers} | {parts[0]} | {parts[1]} | {scanned / unrolled:.2f} |")


if __name__ == "__main__":
    main()
