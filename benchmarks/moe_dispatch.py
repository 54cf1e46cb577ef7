"""MoE dispatch: step time of the capacity dispatch (GShard one-hot einsums, tokens over
capacity dropped) against the dropless one (tokens sorted by expert, ``jax.lax.ragged_dot``)
in one run, at 8 and 32 experts, on one device and under ExpertParallel(8).

    python benchmarks/moe_dispatch.py [--experts 8 32] [--steps 5]

The model is MoE blocks alone on a residual stream (a projection in, ``--layers`` blocks,
a projection out; MSE plus the load-balance loss), so the step is mostly dispatch and
experts. Each row trains the same model from the same initial parameters under AdamW;
step time is the median of ``--steps`` steps after a warm-up step. CPU devices share two
cores here: the ratios compare dispatches on this machine, not hardware.
"""

from __future__ import annotations

import argparse
import statistics

# Simulated CPU devices, and JAX kept on the CPU where no accelerator is (the tpu-plan
# extra's libtpu would start and print its warnings); a GPU or TPU machine is left as is.
from nnx_spmd_trainer.app.host_devices import simulate_host_devices  # noqa: E402

simulate_host_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from moe_layouts import StepTimes  # noqa: E402

from nnx_spmd_trainer import DataParallel, ExpertParallel, Trainer  # noqa: E402
from nnx_spmd_trainer.nn.moe import MoE, moe_losses  # noqa: E402
from nnx_spmd_trainer.nn.moe_dropless import exchange_for  # noqa: E402


class MoEStack(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, *, args: argparse.Namespace, experts: int,
                 capacity_factor: float | None) -> None:  # fmt: skip
        self.inp = nnx.Linear(args.features, args.embed, rngs=rngs)
        block = dict(top_k=2, capacity_factor=capacity_factor, rngs=rngs)
        self.blocks = nnx.List(
            [MoE(args.embed, args.ff, experts, **block) for _ in range(args.layers)]
        )
        self.out = nnx.Linear(args.embed, args.features, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


def loss_fn(model: nnx.Module, batch: dict) -> tuple[jax.Array, dict]:
    mse = jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
    extra, aux = moe_losses(model)
    return mse + extra, {"moe_dropped_fraction": aux["moe_dropped_fraction"]}


def step_ms(args, experts, capacity_factor, strategy, devices, batches) -> tuple[float, float]:
    timer = StepTimes()
    dropped: list[float] = []

    def recording_loss(model, batch):
        loss, aux = loss_fn(model, batch)
        jax.debug.callback(lambda d: dropped.append(float(d)), aux["moe_dropped_fraction"])
        return loss, {}

    trainer = Trainer(
        lambda rngs: MoEStack(rngs, args=args, experts=experts, capacity_factor=capacity_factor),
        optax.adamw(1e-3), strategy=strategy, loss_fn=recording_loss, callbacks=[timer],
        track_norms=False, devices=devices,
    )  # fmt: skip
    trainer.fit(batches, max_steps=len(batches))
    return 1e3 * statistics.median(timer.times[1:]), float(np.mean(dropped))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--embed", type=int, default=64)
    parser.add_argument("--ff", type=int, default=256)
    parser.add_argument("--features", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    shape = (args.batch, args.seq, args.features)
    batches = [
        {"x": rng.normal(size=shape).astype(np.float32),
         "y": rng.normal(size=shape).astype(np.float32)}
        for _ in range(args.steps + 1)
    ]  # fmt: skip
    layouts = {
        "one device": (DataParallel(1), jax.devices()[:1]),
        "ExpertParallel(8)": (ExpertParallel(8), jax.devices()[:8]),
    }
    platform = jax.devices()[0].platform
    print(
        f"MoE stack: {args.layers} MoE blocks (top-2), embed {args.embed}, ff {args.ff}, "
        f"seq {args.seq}, batch {args.batch}; capacity_factor {args.capacity_factor} vs "
        f"dropless; {jax.device_count()} {platform} devices; dropless exchange under an "
        f"expert axis here: {exchange_for(platform)}\n"
    )
    print("| experts | layout | capacity ms | dropped by capacity | dropless ms | "
          "dropless / capacity |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for experts in args.experts:
        for name, (strategy, devices) in layouts.items():
            capacity, dropped = step_ms(args, experts, args.capacity_factor, strategy,
                                        devices, batches)  # fmt: skip
            dropless, none = step_ms(args, experts, None, strategy, devices, batches)
            assert none == 0.0, none
            print(
                f"| {experts} | {name} | {capacity:.0f} | {dropped:.1%} | {dropless:.0f} | "
                f"{dropless / capacity:.2f}x |",
                flush=True,
            )


if __name__ == "__main__":
    main()
