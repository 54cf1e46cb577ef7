"""The compiled train step's temporary bytes per device as SequenceParallel splits a long sequence.

A small GPT (width 64, 4 heads, 2 layers, vocabulary 256) on a global batch of
2 sequences of 2048 tokens, SGD; ``SequenceParallel(n)`` on ``n`` simulated CPU
devices for n = 1, 2, 4, 8: the same global batch, the sequence split n ways.
From the compiler alone (``Plan.report``: no array is built, no step runs):
temporaries per device and their ratio to one device, the collectives of the
step (the all-gathers of keys and values, per layer, forward and backward) and
the FLOPs per device.

    python benchmarks/sequence_memory.py [--seq-len 2048] [--layers 2]
"""

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from nnx_spmd_trainer import Plan, SequenceParallel  # noqa: E402
from nnx_spmd_trainer.app.models import GPT, gpt  # noqa: E402
from nnx_spmd_trainer.plan_report import size  # noqa: E402

ROWS, VOCAB = 2, 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    args = parser.parse_args()
    shapes = {
        name: jax.ShapeDtypeStruct((ROWS, args.seq_len), jnp.int32)
        for name in ("inputs", "targets")
    }

    def model(rngs):
        return GPT(
            vocab_size=VOCAB, seq_len=args.seq_len, embed_dim=args.width, num_heads=4,
            ff_dim=2 * args.width, num_layers=args.layers, dropout_rate=0.0, rngs=rngs,
        )  # fmt: skip

    print(
        f"GPT width {args.width}, {args.layers} layers, batch {ROWS} x {args.seq_len} tokens, "
        f"SGD; {jax.devices()[0].platform} ({len(jax.devices())} devices)"
    )
    header = f"{'seq':>4} {'temp/device':>12} {'ratio':>6} {'GFLOP/device':>13}  collectives"
    print(header)
    print("-" * len(header))
    first = None
    for n in (1, 2, 4, 8):
        plan = Plan(
            model,
            optax.sgd(0.1),
            strategy=SequenceParallel(n),
            loss_fn=gpt.loss_fn,
            devices=jax.devices()[:n],
        )
        report = plan.report(shapes)
        temp = report.memory["temporaries"]
        first = first or temp
        used = {k: v for k, v in report.collectives.items() if v["count"]}
        collectives = (
            ", ".join(f"{k} x{v['count']} ({size(v['bytes'])})" for k, v in used.items()) or "none"
        )
        print(
            f"{n:>4} {size(temp):>12} {temp / first:>6.3f} {report.flops / 1e9:>13.2f}  "
            f"{collectives}"
        )


if __name__ == "__main__":
    main()
