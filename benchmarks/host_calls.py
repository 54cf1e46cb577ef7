"""Python function calls per ``Trainer.fit`` step, counted by cProfile.

    python benchmarks/host_calls.py [--strategy dp|fsdp|hybrid] [--steps 100]

Wall-time ratios (``trainer_overhead.py``) move by several percent with the load of a
shared 2-core machine; the number of Python calls the trainer makes per step does not.
Run it on two commits (``PYTHONPATH=<other checkout>``) to see whether a change added
host-side work to every step.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

# Simulated CPU devices, and JAX kept on the CPU where no accelerator is (the tpu-plan
# extra's libtpu would start and print its warnings); a GPU or TPU machine is left as is.
from nnx_spmd_trainer.app.host_devices import simulate_host_devices  # noqa: E402

simulate_host_devices(8)
sys.path.insert(0, str(Path(__file__).parent))

import jax  # noqa: E402
import trainer_overhead  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=sorted(trainer_overhead.STRATEGIES), default="dp")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--top", type=int, default=15, help="functions listed by own time")
    args = parser.parse_args()
    data = trainer_overhead.batches(args.steps)
    trainer = trainer_overhead.trainer_loop(args.strategy, data)
    trainer.fit(data[:20], max_steps=20)  # compiled and warm before counting
    profile = cProfile.Profile()
    profile.enable()
    trainer.fit(data, max_steps=trainer.step + len(data))
    jax.block_until_ready(trainer.state)
    profile.disable()
    listing = io.StringIO()
    stats = pstats.Stats(profile, stream=listing)
    print(f"strategy={trainer.strategy!r} steps={len(data)}")
    print(f"python calls per step: {stats.total_calls / len(data):.0f}")  # type: ignore[attr-defined]
    stats.sort_stats("tottime").print_stats(args.top)
    print(listing.getvalue())


if __name__ == "__main__":
    main()
