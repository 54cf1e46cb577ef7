"""Trainer step time vs a hand-written ``jax.jit`` loop, measured side by side.

    python benchmarks/trainer_overhead.py [--steps 200] [--strategy dp|fsdp|hybrid]

Both loops run the same model, optimizer, batches and layout; the hand-written
one is the Flax performance guide's functional loop (split state, ``jax.jit``
with donation, ``nnx.merge`` inside). The machine is shared and noisy, so the
two are interleaved over several rounds and the ratio of medians is printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from nnx_spmd_trainer import FSDP, DataParallel, Hybrid, TensorParallel, Trainer  # noqa: E402

STRATEGIES = {
    "dp": lambda: DataParallel(),
    "fsdp": lambda: FSDP(),
    "hybrid": lambda: Hybrid(FSDP(4), TensorParallel(2)),
}


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, width: int = 256) -> None:
        init = nnx.initializers.lecun_normal()
        self.l1 = nnx.Linear(
            64, width, kernel_init=nnx.with_partitioning(init, (None, "model")), rngs=rngs
        )
        self.l2 = nnx.Linear(
            width, 10, kernel_init=nnx.with_partitioning(init, ("model", None)), rngs=rngs
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.l2(nnx.relu(self.l1(x)))


def loss_fn(model: nnx.Module, batch: dict) -> tuple[jax.Array, dict]:
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), {}


def batches(n: int, size: int = 64) -> list[dict]:
    rng = np.random.default_rng(0)
    return [
        {
            "x": rng.normal(size=(size, 64)).astype(np.float32),
            "y": rng.integers(0, 10, size).astype(np.int32),
        }
        for _ in range(n)
    ]


def time_trainer(trainer: Trainer, data: list[dict]) -> float:
    trainer.fit(data[:2], max_steps=2)  # compile outside the timed region
    start = time.perf_counter()
    trainer.fit(data, max_steps=trainer.step + len(data))
    return (time.perf_counter() - start) / len(data)


def time_hand_written(trainer: Trainer, data: list[dict]) -> float:
    """The reference loop, using the trainer only for its already-sharded state."""
    graphdef, state = nnx.split({"model": trainer.model, "optimizer": trainer.optimizer})
    shardings = trainer.plan.shardings
    batch_sharding = trainer.strategy.batch_sharding(data[0], trainer.mesh)

    def step(state, batch):
        objects = nnx.merge(graphdef, state)
        model, optimizer = objects["model"], objects["optimizer"]
        loss, grads = nnx.value_and_grad(lambda m: loss_fn(m, batch)[0])(model)
        optimizer.update(model, grads)
        return nnx.state(objects), loss

    jitted = jax.jit(
        step,
        in_shardings=(shardings, batch_sharding),
        out_shardings=(shardings, None),
        donate_argnums=0,
    )
    state = jax.device_put(jax.tree.map(lambda x: x.copy(), state), shardings)
    place = lambda b: jax.device_put(b, batch_sharding)
    with jax.set_mesh(trainer.mesh):
        state, loss = jitted(state, place(data[0]))
        loss.block_until_ready()
        start = time.perf_counter()
        pending = []
        for batch in data:
            state, loss = jitted(state, place(batch))
            pending.append(loss)
            if len(pending) > 2:  # same in-flight bound as the trainer's default
                pending.pop(0).block_until_ready()
        jax.block_until_ready(state)
    return (time.perf_counter() - start) / len(data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--strategy", choices=sorted(STRATEGIES), default="hybrid")
    args = parser.parse_args()
    data = batches(args.steps)
    trainer = Trainer(
        lambda r: MLP(r), optax.adam(1e-3), strategy=STRATEGIES[args.strategy](), loss_fn=loss_fn
    )
    ours, hand = [], []
    for _ in range(args.rounds):
        ours.append(time_trainer(trainer, data))
        hand.append(time_hand_written(trainer, data))
    print(
        f"devices={jax.device_count()} strategy={trainer.strategy!r} steps={args.steps} "
        f"rounds={args.rounds}"
    )
    print(f"trainer      median {statistics.median(ours) * 1e3:.3f} ms/step")
    print(f"hand-written median {statistics.median(hand) * 1e3:.3f} ms/step")
    print(f"ratio trainer/hand-written = {statistics.median(ours) / statistics.median(hand):.3f}")


if __name__ == "__main__":
    main()
