"""Checkpoint speed: how long an async save blocks training, against a sync save and a restore.

    python benchmarks/checkpoint_speed.py [--width 2048] [--layers 4] [--rounds 7] [--json PATH]

One training state (an MLP of ``layers`` square ``width`` x ``width`` layers with
its Adam state, laid out by ``--strategy`` on 8 simulated devices) is saved with
``OrbaxCheckpoint`` and restored, and each round measures, side by side:

* blocked: the wall time of ``OrbaxCheckpoint.save(step)`` with ``async_save=True``
  returning, which is what the training loop waits for (the write goes on in the
  background and is waited for outside the timed region); like every save and
  fingerprint timed here, it follows one finished training step, as in a loop;
* the same save with ``async_save=False`` (``save`` returns once written);
* ``restore_into_trainer()`` into a second trainer with the same strategy (which
  recomputes and checks the fingerprints), and ``fingerprints(trainer.state)`` alone;
* training steps started right after an async save returned (the write shares
  the CPU cores with them), against the same steps with nothing being written;
  by default as many steps as one background write lasts.

The machine is shared and noisy, so the measurements are interleaved over
several rounds after a warm-up, and the ratios of medians are printed.
Each mode saves into one directory over the rounds, as a run does (its first,
one-time save falls in the warm-up round); all is removed afterwards.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

# Simulated CPU devices, and JAX kept on the CPU where no accelerator is (the tpu-plan
# extra's libtpu would start and print its warnings); a GPU or TPU machine is left as is.
from nnx_spmd_trainer.app.host_devices import simulate_host_devices  # noqa: E402

simulate_host_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from nnx_spmd_trainer import FSDP, DataParallel, Hybrid, TensorParallel, Trainer  # noqa: E402
from nnx_spmd_trainer.callbacks import OrbaxCheckpoint  # noqa: E402
from nnx_spmd_trainer.callbacks.fingerprint import fingerprints  # noqa: E402

STRATEGIES = {
    "dp": lambda: DataParallel(),
    "fsdp": lambda: FSDP(),
    "hybrid": lambda: Hybrid(FSDP(4), TensorParallel(2)),
}
IN_FEATURES, CLASSES = 64, 10


class MLP(nnx.Module):
    """Unannotated, so FSDP shards the largest dimension of every kernel."""

    def __init__(self, rngs: nnx.Rngs, width: int, layers: int) -> None:
        self.inp = nnx.Linear(IN_FEATURES, width, rngs=rngs)
        self.hidden = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(layers)])
        self.out = nnx.Linear(width, CLASSES, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = nnx.relu(self.inp(x))
        for layer in self.hidden:
            x = nnx.relu(layer(x))
        return self.out(x)


def loss_fn(model: nnx.Module, batch: dict) -> tuple[jax.Array, dict]:
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), {}


def batches(n: int, size: int) -> list[dict]:
    rng = np.random.default_rng(0)
    return [
        {
            "x": rng.normal(size=(size, IN_FEATURES)).astype(np.float32),
            "y": rng.integers(0, CLASSES, size).astype(np.int32),
        }
        for _ in range(n)
    ]


def state_bytes(state: Any) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))


def versions() -> dict[str, str]:
    found = {}
    for name in ("jax", "jaxlib", "flax", "orbax-checkpoint", "tensorstore"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


class Saves:
    """One ``OrbaxCheckpoint`` per mode (async, sync), each saving every round as a
    training run saves into one directory: the first save of a run (one-time setup)
    falls in the warm-up round. Each keeps its last two steps."""

    def __init__(self, root: Path, trainer: Trainer) -> None:
        self.root, self.trainer = root, trainer
        self.by_mode: dict[bool, OrbaxCheckpoint] = {}

    def checkpoint(self, *, async_save: bool) -> OrbaxCheckpoint:
        if async_save not in self.by_mode:
            directory = self.root / ("async" if async_save else "sync")
            checkpoint = OrbaxCheckpoint(directory, async_save=async_save, keep=2)
            checkpoint.set_trainer(self.trainer)
            checkpoint.manager  # noqa: B018 -- created (and the directory with it) outside the timing
            self.by_mode[async_save] = checkpoint
        return self.by_mode[async_save]

    @staticmethod
    def discard(checkpoint: OrbaxCheckpoint) -> None:
        """Waits for the write (and the deletion of steps beyond ``keep``)."""
        checkpoint.manager.wait_until_finished()

    def close(self) -> None:
        for checkpoint in self.by_mode.values():
            checkpoint.manager.wait_until_finished()
            checkpoint.manager.close()

    def advance(self, data: list[dict]) -> None:
        """One training step, finished, as a save in a training loop follows a step."""
        fit_steps(self.trainer, data[:1])
        self.settle()

    def settle(self) -> None:
        """Nothing of the trainer's in flight: a save then times the save alone."""
        jax.block_until_ready(self.trainer.state)
        record = self.trainer.last_step
        assert record is None or np.isfinite(record.loss_value()), record


def time_async_save(saves: Saves, data: list[dict]) -> tuple[float, float]:
    """(blocked, save to committed): what ``save`` holds the loop for, and the whole write."""
    checkpoint = saves.checkpoint(async_save=True)
    saves.advance(data)
    start = time.perf_counter()
    assert checkpoint.save(saves.trainer.step)
    blocked = time.perf_counter() - start
    checkpoint.manager.wait_until_finished()
    total = time.perf_counter() - start
    saves.discard(checkpoint)
    return blocked, total


def time_sync_save(saves: Saves, data: list[dict]) -> float:
    checkpoint = saves.checkpoint(async_save=False)
    saves.advance(data)
    start = time.perf_counter()
    assert checkpoint.save(saves.trainer.step)
    elapsed = time.perf_counter() - start
    saves.discard(checkpoint)
    return elapsed


def time_restore(reader: OrbaxCheckpoint, expected: dict[str, int]) -> float:
    jax.block_until_ready(reader.trainer.state)
    start = time.perf_counter()
    step = reader.restore_into_trainer()
    jax.block_until_ready(reader.trainer.state)
    elapsed = time.perf_counter() - start
    assert step is not None and fingerprints(reader.trainer.state) == expected
    return elapsed


def time_fingerprints(saves: Saves, data: list[dict]) -> float:
    saves.advance(data)
    state = saves.trainer.state
    start = time.perf_counter()
    fingerprints(state)
    return time.perf_counter() - start


def fit_steps(trainer: Trainer, data: list[dict]) -> float:
    """Seconds of one ``fit`` over ``data``, its steps finished."""
    start = time.perf_counter()
    trainer.fit(data, max_steps=trainer.step + len(data))
    jax.block_until_ready(trainer.state)
    return time.perf_counter() - start


def time_steps_while_writing(
    saves: Saves, data: list[dict], idle_first: bool
) -> tuple[float, float, float]:
    """(s/step with an async write started just before, s/step with none, write left after).

    The steps are the same ``len(data)`` each way; the last value is how long
    the write still ran after the steps had finished (0 when it ended among them).
    """
    idle = fit_steps(saves.trainer, data) if idle_first else float("nan")
    checkpoint = saves.checkpoint(async_save=True)
    saves.settle()
    assert checkpoint.save(saves.trainer.step)
    writing = fit_steps(saves.trainer, data)
    start = time.perf_counter()
    checkpoint.manager.wait_until_finished()
    left = time.perf_counter() - start
    saves.discard(checkpoint)
    if not idle_first:
        saves.settle()
        idle = fit_steps(saves.trainer, data)
    return writing / len(data), idle / len(data), left


def median(values: list[float]) -> float:
    finite = [v for v in values if np.isfinite(v)]
    return statistics.median(finite) if finite else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048, help="hidden width of the MLP")
    parser.add_argument("--layers", type=int, default=4, help="hidden width x width layers")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    parser.add_argument(
        "--overlap-steps",
        type=int,
        default=0,
        help="train steps timed from an async save on (default: about one write's length)",
    )
    parser.add_argument("--strategy", choices=sorted(STRATEGIES), default="fsdp")
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = parser.parse_args()

    def make_trainer() -> Trainer:
        return Trainer(
            lambda r: MLP(r, args.width, args.layers),
            optax.adam(1e-3),
            strategy=STRATEGIES[args.strategy](),
            loss_fn=loss_fn,
        )

    trainer, target = make_trainer(), make_trainer()
    data = batches(max(args.overlap_steps, 2), args.batch)
    trainer.fit(data[:2], max_steps=2)  # compiled, and a finite last_loss
    state = trainer.state
    size_mb = state_bytes(state) / 2**20
    params = sum(x.size for x in jax.tree.leaves(nnx.state(trainer.model, nnx.Param)))

    results: dict[str, list[float]] = {
        k: [] for k in ("blocked", "async_total", "sync", "restore", "fingerprints")
    }
    results.update(step_writing=[], step_idle=[], write_left=[])
    with tempfile.TemporaryDirectory(prefix="checkpoint_speed_") as tmp:
        saves = Saves(Path(tmp), trainer)
        # The restore source: written once, read back into `target` every round (the
        # files are then in the page cache, as a just-written checkpoint's are).
        source = OrbaxCheckpoint(Path(tmp) / "source", async_save=False)
        source.set_trainer(trainer)
        saves.settle()
        assert source.save(trainer.step)
        expected = fingerprints(trainer.state)
        reader = OrbaxCheckpoint(source.directory, restore="latest")
        reader.set_trainer(target)
        for round_ in range(args.rounds + 1):  # round 0 is the warm-up
            blocked, total = time_async_save(saves, data)
            sync = time_sync_save(saves, data)
            restore = time_restore(reader, expected)
            fingerprint = time_fingerprints(saves, data)
            writing, idle, left = time_steps_while_writing(saves, data, round_ % 2 == 1)
            if round_ == 0:
                if not args.overlap_steps:  # enough steps to span one background write
                    data = batches(max(2, math.ceil((total - blocked) / idle)), args.batch)
                continue
            for key, value in (
                ("blocked", blocked),
                ("async_total", total),
                ("sync", sync),
                ("restore", restore),
                ("fingerprints", fingerprint),
                ("step_writing", writing),
                ("step_idle", idle),
                ("write_left", left),
            ):
                results[key].append(value)
        reader.manager.close()
        source.manager.close()
        saves.close()

    # What one async save costs the training loop in all: the time it blocks, plus
    # how much slower the steps overlapping its write ran (the write shares the cores).
    results["async_lost"] = [
        b + len(data) * (w - i)
        for b, w, i in zip(
            results["blocked"], results["step_writing"], results["step_idle"], strict=True
        )
    ]
    med = {key: median(values) for key, values in results.items()}
    ratios = {
        "blocked_async/sync": med["blocked"] / med["sync"],
        "async_total/sync": med["async_total"] / med["sync"],
        "restore/sync": med["restore"] / med["sync"],
        "async_lost/sync": med["async_lost"] / med["sync"],
        "fingerprints/blocked": med["fingerprints"] / med["blocked"],
        "steps_per_s_writing/idle": med["step_idle"] / med["step_writing"],
    }
    info = {
        "devices": jax.device_count(),
        "strategy": repr(trainer.strategy),
        "width": args.width,
        "layers": args.layers,
        "params": params,
        "state_mb": round(size_mb, 1),
        "rounds": args.rounds,
        "overlap_steps": len(data),
        "versions": versions(),
    }

    print(
        f"devices={info['devices']} strategy={info['strategy']} params={params / 1e6:.1f}M "
        f"state={size_mb:.1f} MB (params + Adam) rounds={args.rounds}"
    )
    print(" ".join(f"{k}={v}" for k, v in info["versions"].items()))
    print()
    print("| measurement | median | vs sync save |")
    print("|---|---:|---:|")
    rows = [
        ("async save: blocked (save returns)", "blocked"),
        ("async save: save to committed", "async_total"),
        ("sync save", "sync"),
        ("restore_into_trainer (verified)", "restore"),
        ("fingerprints(trainer.state) alone", "fingerprints"),
    ]
    for label, key in rows:
        print(f"| {label} | {med[key] * 1e3:.1f} ms | {med[key] / med['sync']:.3f} |")
    print(f"| train step, no write | {med['step_idle'] * 1e3:.1f} ms | |")
    print(
        f"| train step, async write in background ({len(data)} steps from the save) | "
        f"{med['step_writing'] * 1e3:.1f} ms | |"
    )
    print(f"| write still running after those steps | {med['write_left'] * 1e3:.1f} ms | |")
    print(
        "| async save: training time lost (blocked + slowdown of those steps) | "
        f"{med['async_lost'] * 1e3:.1f} ms | {ratios['async_lost/sync']:.3f} |"
    )
    print()
    target_note = "under" if ratios["blocked_async/sync"] < 0.1 else "NOT under"
    print(
        f"ratio blocked async / sync = {ratios['blocked_async/sync']:.3f} "
        f"({target_note} the 0.10 target)"
    )
    print(f"ratio training time lost to an async save / sync = {ratios['async_lost/sync']:.3f}")
    print(f"ratio restore / sync = {ratios['restore/sync']:.3f}")
    print(f"ratio fingerprints / blocked = {ratios['fingerprints/blocked']:.3f}")
    print(f"ratio steps/s while writing / steps/s idle = {ratios['steps_per_s_writing/idle']:.3f}")
    if args.json is not None:
        report = {
            **info,
            "median_s": med,
            "ratios": ratios,
            "samples_s": results,
        }
        args.json.write_text(json.dumps(report, indent=2, default=float) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
