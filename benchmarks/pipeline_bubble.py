"""PipelineParallel's step time against the GPipe bubble, and its memory against FSDP(8).

A scanned GPT (8 layers, width 64, 4 heads, 64 tokens, vocabulary 64) on a global
batch of 32 rows, SGD, through ``Trainer.fit`` on ``S`` simulated CPU devices for
S = 2, 4, 8 and M = S, 2S, 4S microbatches: the median step time after a warm-up.

The schedule's shifted buffer runs every stage on every one of the ``M + S - 1``
ticks (filler in the bubble), so a step takes ``(M + S - 1) / M`` times its useful
work, on real devices (each idles, or computes filler, for the bubble's share
``(S-1)/(M+S-1)`` of the step) as on simulated CPU devices (which share the same
cores, so all of it is computed in turn): the last column is that ratio over the
M = 4S one, to compare with the measured one before it.
Then, from the compiler alone (``Plan.report``), the peak bytes per device of
``PipelineParallel(8)`` against ``FSDP(8)`` on the same model and batch.

    python benchmarks/pipeline_bubble.py [--steps 6] [--out benchmarks/results/pipeline_bubble.md]
"""

import argparse
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from nnx_spmd_trainer import FSDP, Callback, PipelineParallel, Plan, Trainer  # noqa: E402
from nnx_spmd_trainer.app.models import GPT, gpt  # noqa: E402
from nnx_spmd_trainer.planner.plan_report import size  # noqa: E402

ROWS, SEQ, VOCAB, LAYERS = 32, 64, 64, 8


def model(rngs):
    return GPT(
        vocab_size=VOCAB, seq_len=SEQ, embed_dim=64, num_heads=4, ff_dim=128,
        num_layers=LAYERS, dropout_rate=0.0, rngs=rngs, scan_layers=True,
    )  # fmt: skip


def batches(n):
    rng = np.random.default_rng(0)
    windows = (rng.integers(0, VOCAB, size=(ROWS, SEQ + 1), dtype=np.int32) for _ in range(n))
    return [{"inputs": w[:, :-1], "targets": w[:, 1:]} for w in windows]


class StepTimes(Callback):
    """The wall time of each step, the loss read back (a sync) at its end."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, step: int, logs: dict) -> None:
        self.trainer.last_step.loss_value()
        self.ends.append(time.perf_counter())


def step_time(strategy, devices, steps):
    times = StepTimes()
    trainer = Trainer(
        model, optax.sgd(0.1), strategy=strategy, loss_fn=gpt.loss_fn,
        callbacks=[times], devices=jax.devices()[:devices],
    )  # fmt: skip
    trainer.fit(batches(steps), max_steps=steps)
    return statistics.median(np.diff(times.ends[1:]))  # the first step compiles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    lines = [
        f"GPT {LAYERS} layers x width 64, batch {ROWS} x {SEQ} tokens, SGD; "
        f"{jax.devices()[0].platform}, {os.cpu_count()} cores, simulated devices",
        "",
        "| S | M | bubble (S-1)/(M+S-1) | step ms | time / time(M=4S) | (M+S-1)/M over M=4S |",
        "|---|---|---|---|---|---|",
    ]  # fmt: skip
    for stages in (2, 4, 8):
        micro = (stages, 2 * stages, 4 * stages)
        timed = {m: step_time(PipelineParallel(stages, microbatches=m), stages, args.steps)
                 for m in micro}  # fmt: skip
        base, base_work = timed[4 * stages], (5 * stages - 1) / (4 * stages)
        for m in micro:
            bubble = PipelineParallel(stages, microbatches=m).bubble(stages)
            work = (m + stages - 1) / m / base_work
            lines.append(
                f"| {stages} | {m} | {bubble:.1%} | {timed[m] * 1e3:.1f} | "
                f"{timed[m] / base:.2f} | {work:.2f} |"
            )
            print(lines[-1], flush=True)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batches(1)[0])
    lines += ["", "| strategy (8 devices) | peak per device | state per device |", "|---|---|---|"]
    for strategy in (PipelineParallel(8), FSDP(8)):
        report = Plan(model, optax.sgd(0.1), strategy=strategy, loss_fn=gpt.loss_fn).report(shapes)
        state = report.bytes_per_device("parameters") + report.bytes_per_device("optimizer")
        lines.append(f"| {strategy!r} | {size(report.memory['peak'])} | {size(state)} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
