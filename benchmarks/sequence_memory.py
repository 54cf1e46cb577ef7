"""The compiled train step's temporary bytes per device as SequenceParallel splits a long
sequence, with keys and values all-gathered along ``seq`` and passed round it (ring).

A small GPT (width 64, 4 heads, 2 layers, vocabulary 256) on a global batch of
2 sequences, SGD; ``SequenceParallel(n, attention=form)`` on ``n`` simulated
CPU devices for n = 1, 2, 4, 8: the same global batch, the sequence split n
ways. Memory from the compiler alone (``Plan.report``: no array is built, no
step runs): temporaries per device of both forms at each sequence length and
their ratio to one device, the collectives of the ring step, and the causal
blocks each device computes in the ring (``ring_blocks``: balanced order).
Then step time of both forms, measured in the same run (``Trainer.fit``,
compile excluded, median of the timed steps) at the ``--time-lens``.

    python benchmarks/sequence_memory.py [--seq-lens 2048 8192] [--time-lens 512 2048]
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from nnx_spmd_trainer import Plan, SequenceParallel, Trainer  # noqa: E402
from nnx_spmd_trainer.app.models import GPT, gpt  # noqa: E402
from nnx_spmd_trainer.callbacks import Callback  # noqa: E402
from nnx_spmd_trainer.nn.ring_attention import ring_blocks  # noqa: E402
from nnx_spmd_trainer.planner.plan_report import size  # noqa: E402

ROWS, VOCAB, SIZES = 2, 256, (1, 2, 4, 8)


def model_for(seq_len: int, args: argparse.Namespace):  # type: ignore[no-untyped-def]
    def model(rngs):  # type: ignore[no-untyped-def]
        return GPT(
            vocab_size=VOCAB, seq_len=seq_len, embed_dim=args.width, num_heads=4,
            ff_dim=2 * args.width, num_layers=args.layers, dropout_rate=0.0, rngs=rngs,
        )  # fmt: skip

    return model


def strategy(n: int, form: str) -> SequenceParallel:
    return SequenceParallel(n, attention=form)


def memory_table(seq_len: int, args: argparse.Namespace) -> None:
    shapes = {k: jax.ShapeDtypeStruct((ROWS, seq_len), jnp.int32) for k in ("inputs", "targets")}
    print(f"\n### sequence {seq_len}: temporaries per device (compiled step)\n")
    print("| seq | all_gather | ratio | ring | ratio | ring blocks/device | ring collectives |")
    print("|---:|---:|---:|---:|---:|---|---|")
    first: dict[str, int] = {}
    for n in SIZES:
        row, collectives = [], ""
        for form in ("all_gather", "ring"):
            plan = Plan(
                model_for(seq_len, args), optax.sgd(0.1), strategy=strategy(n, form),
                loss_fn=gpt.loss_fn, devices=jax.devices()[:n],
            )  # fmt: skip
            report = plan.report(shapes)
            temp = report.memory["temporaries"]
            first.setdefault(form, temp)
            row += [size(temp), f"{temp / first[form]:.3f}"]
            if form == "ring":
                used = {k: v for k, v in report.collectives.items() if v["count"]}
                collectives = ", ".join(f"{k} x{v['count']}" for k, v in used.items()) or "none"
        blocks = ring_blocks(n) if n > 1 else [1]
        print(f"| {n} | {' | '.join(row)} | {min(blocks)}-{max(blocks)} | {collectives} |")


class StepTimes(Callback):
    """Wall-clock time of every step, blocking on its loss (steps are asynchronous)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.start = 0.0

    def on_train_batch_begin(self, step, logs=None):  # type: ignore[no-untyped-def]
        self.start = time.perf_counter()

    def on_train_batch_end(self, step, logs=None):  # type: ignore[no-untyped-def]
        jax.block_until_ready(logs)
        self.times.append(time.perf_counter() - self.start)


def step_time(seq_len: int, n: int, form: str, args: argparse.Namespace) -> float:
    rng = np.random.default_rng(0)
    windows = rng.integers(0, VOCAB, size=(args.steps + 1, ROWS, seq_len + 1), dtype=np.int32)
    batches = [{"inputs": w[:, :-1], "targets": w[:, 1:]} for w in windows]
    timer = StepTimes()
    trainer = Trainer(
        model_for(seq_len, args), optax.sgd(0.1), strategy=strategy(n, form),
        loss_fn=gpt.loss_fn, callbacks=[timer], devices=jax.devices()[:n],
        log_every_n_steps=1, max_steps_in_flight=1,
    )  # fmt: skip
    trainer.fit(batches, max_steps=len(batches))
    return statistics.median(timer.times[1:])  # the first step compiles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="*", default=[2048, 8192])
    parser.add_argument("--time-lens", type=int, nargs="*", default=[128, 512, 2048])
    parser.add_argument("--time-seq", type=int, default=8, help="the seq axis timed")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per form")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    args = parser.parse_args()
    print(
        f"GPT width {args.width}, {args.layers} layers, batch {ROWS} sequences, SGD; "
        f"{jax.devices()[0].platform} ({len(jax.devices())} devices)"
    )
    for seq_len in args.seq_lens:
        memory_table(seq_len, args)
    n = args.time_seq
    print(f"\n### step time, SequenceParallel({n}) (median of {args.steps} steps)\n")
    print("| sequence | all_gather | ring | ring / all_gather |")
    print("|---:|---:|---:|---:|")
    for seq_len in args.time_lens:
        gather, ring = (step_time(seq_len, n, form, args) for form in ("all_gather", "ring"))
        print(f"| {seq_len} | {gather * 1e3:.1f} ms | {ring * 1e3:.1f} ms | {ring / gather:.2f} |")


if __name__ == "__main__":
    main()
