"""Trainer step time vs the floor (``floor.py``: the fastest hand-written loop), side by side.

    python benchmarks/trainer_overhead.py [--strategy dp|fsdp|hybrid] [--steps 150]
        [--rounds 31] [--variants]

All loops run the same model, optimizer, batches and layout. The machine is
shared and its speed drifts, so they are interleaved over several rounds, each
run forward then backward (``floor.interleaved_rounds``: a drift over the round
cancels), and the ratio is the median of the per-round ratios, printed beside
the ratio of medians. ``--variants`` also times the
trainer with prefetching and donation each on and off: the measurement behind ``backend_defaults``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

# Simulated CPU devices, and JAX kept on the CPU where no accelerator is (the tpu-plan
# extra's libtpu would start and print its warnings); a GPU or TPU machine is left as is.
from nnx_spmd_trainer.app.host_devices import simulate_host_devices  # noqa: E402

simulate_host_devices(8)
sys.path.insert(0, str(Path(__file__).parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from floor import (  # noqa: E402
    PREFIX,
    Loss,
    floor,
    hand_written_loops,
    held_out_ratio,
    interleaved_rounds,
    paired_ratio,
)

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


def trainer_loop(strategy: str, data: list[dict], **options: object) -> Trainer:
    return Trainer(
        lambda r: MLP(r),
        optax.adam(1e-3),
        strategy=STRATEGIES[strategy](),
        loss_fn=loss_fn,
        metrics=Loss,
        **options,  # type: ignore[arg-type]
    )


def timed(trainer: Trainer, data: list[dict]) -> Callable[[], float]:
    """Seconds per step of ``trainer.fit`` over ``data``, compiled beforehand."""
    trainer.fit(data[:2], max_steps=2)

    def run() -> float:
        start = time.perf_counter()
        trainer.fit(data, max_steps=trainer.step + len(data))
        jax.block_until_ready(trainer.state)
        return (time.perf_counter() - start) / len(data)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--strategy", choices=sorted(STRATEGIES), default="hybrid")
    parser.add_argument("--variants", action="store_true", help="prefetch and donation on/off")
    args = parser.parse_args()
    data = batches(args.steps)
    trainer = trainer_loop(args.strategy, data)
    loops = {"trainer (defaults)": timed(trainer, data)}
    if args.variants:  # each setting against the defaults, all else equal
        for prefetch in (0, 2):
            for donate in (False, True):
                name = f"trainer (prefetch={prefetch}, donate={donate})"
                loops[name] = timed(
                    trainer_loop(args.strategy, data, prefetch=prefetch, donate=donate), data
                )
    loops.update(hand_written_loops(trainer, data, loss_fn))
    times = interleaved_rounds(loops, args.rounds)
    medians = {name: statistics.median(values) for name, values in times.items()}
    floor_name, floor_time = floor(medians)
    print(
        f"devices={jax.device_count()} platform={jax.devices()[0].platform} "
        f"strategy={trainer.strategy!r} steps={args.steps} rounds={args.rounds}"
    )
    for name, seconds in medians.items():
        print(f"{seconds * 1e3:8.3f} ms/step  x{seconds / floor_time:.3f}  {name}")
    print(f"floor: {floor_name}")
    ours = times["trainer (defaults)"]
    paired = paired_ratio(ours, times[floor_name])
    print(f"ratio trainer/floor, median of per-round ratios = {paired:.3f}")
    print(
        f"ratio trainer/floor, ratio of medians = {medians['trainer (defaults)'] / floor_time:.3f}"
    )
    held_out_floor, held_out = held_out_ratio(times, "trainer (defaults)")
    print(
        f"ratio trainer/floor chosen on other rounds (even rounds choose, odd rounds read) = "
        f"{held_out:.3f} ({held_out_floor})"
    )
    # The trainer's own cost, apart from which of the four ways the noise favoured:
    # against the hand-written loop that donates and places as the trainer does.
    same = f"{PREFIX} ({'donating' if trainer.plan.donate else 'copying'}, " + (
        "placed by a thread)" if trainer.placement.prefetch else "placed inline)"
    )
    print(f"ratio trainer/same-settings hand-written = {paired_ratio(ours, times[same]):.3f}")


if __name__ == "__main__":
    main()
