"""MoE layouts: step time and per-device memory of a mixture-of-experts GPT under the
expert layouts against FSDP(8), one model (equal parameters) on 8 simulated devices.

    python benchmarks/moe_layouts.py [--experts 8] [--embed 128] [--ff 512] [--steps 5]

For each layout: the state bytes per device (parameters + optimizer, the plan's
figures), the compiled step's peak memory per device (``Plan.report``), the bytes of
each collective in that step, and the median wall time of ``--steps`` training steps
after a warm-up step. CPU devices share two cores here: step times compare layouts on
one machine, not hardware; bytes are the compiler's and hold anywhere.
"""

from __future__ import annotations

import argparse
import statistics
import time

# Simulated CPU devices, and JAX kept on the CPU where no accelerator is (the tpu-plan
# extra's libtpu would start and print its warnings); a GPU or TPU machine is left as is.
from nnx_spmd_trainer.app.host_devices import simulate_host_devices  # noqa: E402

simulate_host_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from clu import metrics as clu_metrics  # noqa: E402

from nnx_spmd_trainer import (  # noqa: E402
    FSDP,
    Callback,
    DataParallel,
    ExpertParallel,
    Hybrid,
    Plan,
    Strategy,
    TensorParallel,
    Trainer,
)
from nnx_spmd_trainer.app.models import GPT, gpt  # noqa: E402
from nnx_spmd_trainer.nn.moe import moe_metrics  # noqa: E402


class StepTimes(Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self.last = 0.0

    def on_train_batch_begin(self, step: int, logs: dict) -> None:
        self.last = time.perf_counter()

    def on_train_batch_end(self, step: int, logs: dict) -> None:
        jax.block_until_ready(self.trainer.state)
        self.times.append(time.perf_counter() - self.last)


def layouts() -> dict[str, Strategy]:
    """The expert layouts against FSDP(8), by name (``gpu_speed.py``'s MoE part too)."""
    return {
        "FSDP(8)": FSDP(8),
        "ExpertParallel(8)": ExpertParallel(8),
        "Hybrid(DataParallel(2), ExpertParallel(4))": Hybrid(DataParallel(2), ExpertParallel(4)),
        "Hybrid(ExpertParallel(2), FSDP(2), TensorParallel(2))": Hybrid(
            ExpertParallel(2), FSDP(2), TensorParallel(2)
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--embed", type=int, default=128)
    parser.add_argument("--ff", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    vocab = 64

    def factory(rngs):
        return GPT(vocab_size=vocab, seq_len=args.seq, embed_dim=args.embed, num_heads=4,
                   ff_dim=args.ff, num_layers=args.layers, dropout_rate=0.0, rngs=rngs,
                   moe_experts=args.experts, moe_every=1)  # fmt: skip

    metrics = clu_metrics.Collection.create(
        loss=clu_metrics.Average.from_output("loss"), **moe_metrics(args.experts)
    )
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, size=(args.steps + 1, args.batch, args.seq + 1))
    batches = [{"inputs": t[:, :-1], "targets": t[:, 1:]} for t in tokens.astype(np.int32)]
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batches[0])
    print(
        f"MoE GPT: {args.layers} MoE blocks x {args.experts} experts (top-2), embed "
        f"{args.embed}, ff {args.ff}, seq {args.seq}, batch {args.batch}; "
        f"{jax.device_count()} {jax.devices()[0].platform} devices\n"
    )
    print("| layout | state MiB/device | peak MiB/device | all-gather MiB | "
          "all-reduce MiB | all-to-all MiB | step ms (median) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, strategy in layouts().items():
        plan = Plan(factory, optax.adamw(1e-3), strategy=strategy, loss_fn=gpt.loss_fn,
                    metrics=metrics)  # fmt: skip
        report = plan.report(shapes)
        state = sum(report.bytes_per_device(k) for k in ("parameters", "optimizer"))
        timer = StepTimes()
        trainer = Trainer(plan, callbacks=[timer], track_norms=False)
        trainer.fit(batches, max_steps=len(batches))
        step_ms = 1e3 * statistics.median(timer.times[1:])
        mib = 2.0**20
        c = report.collectives
        print(
            f"| {name} | {state / mib:.2f} | {report.memory['peak'] / mib:.2f} | "
            f"{c['all-gather']['bytes'] / mib:.2f} | {c['all-reduce']['bytes'] / mib:.2f} | "
            f"{c['all-to-all']['bytes'] / mib:.2f} | {step_ms:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
