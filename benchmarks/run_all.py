"""Every benchmark in one run: a Markdown table and a JSON file of ratios to floors.

    python benchmarks/run_all.py [--out benchmarks/results] [--quick]

Each timing is the median over interleaved rounds after a warm-up, and each is
reported as a ratio to the floor measured in the same run (the machine is
shared and noisy: an absolute time alone means little).

1. Step time of ``Trainer.fit`` (with its defaults, and with ``track_norms=False``)
   against the floor (``floor.py``: the fastest of four hand-written ``jax.jit``
   loops over split state doing the same on-device loss averaging, with and
   without donation and a placement thread, all in the table); against the seed
   documents' ``nnx.jit`` loop; and against Keras 3 on the JAX backend with
   ``keras.distribution.DataParallel`` (when keras is installed:
   ``pip install -e ".[bench]"``), for the small MLP and the default GPT under
   DataParallel and FSDP.
2. Memory: per-device bytes of parameters and optimizer state, from the
   shardings and from the compiled step's ``memory_analysis``, against the ideal.
3. Checkpoints: the time an async save blocks training against a sync save
   (``checkpoint_speed.py``), and the share of step time spent waiting for input.

``--quick`` shrinks every size and repeat, and times the MLP only and measures the memory of
DataParallel and FSDP only (the test suite runs it so the script
does not rot; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Simulated CPU devices, and JAX kept on the CPU where no accelerator is (the tpu-plan
# extra's libtpu would start and print its warnings); a GPU or TPU machine is left as is.
from nnx_spmd_trainer.app.host_devices import simulate_host_devices  # noqa: E402

simulate_host_devices(8)
os.environ.setdefault("KERAS_BACKEND", "jax")
sys.path.insert(0, str(Path(__file__).parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from floor import Loss, floor, hand_written_loops, interleaved  # noqa: E402

from nnx_spmd_trainer import FSDP, DataParallel, Hybrid, TensorParallel, Trainer  # noqa: E402
from nnx_spmd_trainer.app.models import GPT, gpt  # noqa: E402
from nnx_spmd_trainer.planner.state import sharding_table  # noqa: E402

STRATEGIES: dict[str, Callable[[], Any]] = {
    "DataParallel": DataParallel,
    "FSDP": lambda: FSDP(min_size=1),
    "FSDP(4) x TP(2)": lambda: Hybrid(FSDP(4, min_size=1), TensorParallel(2)),
}


@dataclasses.dataclass
class Workload:
    name: str
    factory: Callable[[nnx.Rngs], nnx.Module]
    loss_fn: Callable[..., Any]
    batches: list[dict]
    optimizer: Callable[[], optax.GradientTransformation] = lambda: optax.adam(1e-3)


def mlp_workload(steps: int) -> Workload:
    from trainer_overhead import MLP, batches, loss_fn

    return Workload("MLP 64-256-10, batch 64", lambda r: MLP(r), loss_fn, batches(steps))


def gpt_workload(steps: int, quick: bool) -> Workload:
    sizes = dict(seq_len=16, embed_dim=32, num_heads=8, ff_dim=64, num_layers=1)
    if not quick:  # configs/default.py
        sizes = dict(seq_len=64, embed_dim=128, num_heads=8, ff_dim=512, num_layers=2)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 96, (steps, 32, sizes["seq_len"] + 1)).astype(np.int32)
    return Workload(
        f"default GPT ({sizes['num_layers']} x {sizes['embed_dim']}, {sizes['seq_len']} "
        "tokens), batch 32",
        lambda r: GPT(vocab_size=96, dropout_rate=0.0, rngs=r, **sizes),
        gpt.loss_fn,
        [{"inputs": t[:, :-1], "targets": t[:, 1:]} for t in tokens],
    )


# -- the loops ---------------------------------------------------------------------------
def trainer_loop(work: Workload, strategy: Any, **options: Any) -> Callable[[], float]:
    """``Trainer.fit``, logging every 50 steps as the configs do (the norms in those steps)."""
    trainer = Trainer(
        work.factory,
        work.optimizer(),
        strategy=strategy,
        loss_fn=work.loss_fn,
        metrics=Loss,
        **{"log_every_n_steps": 50, **options},
    )
    trainer.fit(work.batches[:2], max_steps=2)  # compiled outside the timed region

    def run() -> float:
        start = time.perf_counter()
        trainer.fit(work.batches, max_steps=trainer.step + len(work.batches))
        jax.block_until_ready(trainer.state)
        trainer.metric_log.flush(trainer.progress.epoch, trainer.run.timings)
        return (time.perf_counter() - start) / len(work.batches)

    return run


def floor_loops(work: Workload, strategy: Any) -> dict[str, Callable[[], float]]:
    """The four hand-written loops of ``floor.py`` for ``work`` under ``strategy``."""
    reference = Trainer(work.factory, work.optimizer(), strategy=strategy, loss_fn=work.loss_fn)
    return hand_written_loops(reference, work.batches, work.loss_fn)


def nnx_jit_loop(work: Workload, strategy: Any) -> Callable[[], float]:
    """The seed documents' loop: ``nnx.jit`` over the model and optimizer objects."""
    trainer = Trainer(work.factory, work.optimizer(), strategy=strategy, loss_fn=work.loss_fn)
    model, optimizer = trainer.model, trainer.optimizer
    batch_sharding = strategy.batch_sharding(work.batches[0], trainer.mesh)

    @nnx.jit
    def step(model: nnx.Module, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, batch: dict):
        loss, grads = nnx.value_and_grad(lambda m: work.loss_fn(m, batch)[0])(model)
        optimizer.update(model, grads)
        metrics.update(loss=loss)
        return loss

    def run() -> float:
        metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
        with jax.set_mesh(trainer.mesh):
            step(model, optimizer, metrics, jax.device_put(work.batches[0], batch_sharding))
            start, pending = time.perf_counter(), []
            for batch in work.batches:
                pending.append(
                    step(model, optimizer, metrics, jax.device_put(batch, batch_sharding))
                )
                if len(pending) > 2:
                    pending.pop(0).block_until_ready()
            jax.block_until_ready(pending)
            float(metrics.compute()["loss"])
        return (time.perf_counter() - start) / len(work.batches)

    return run


def keras_loop(work: Workload) -> Callable[[], float] | None:
    """Keras 3 (JAX backend) with ``keras.distribution.DataParallel``, the MLP only."""
    try:
        import keras
    except ImportError:
        return None
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()))
    model = keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    x = np.concatenate([b["x"] for b in work.batches])
    y = np.concatenate([b["y"] for b in work.batches])
    size = len(work.batches[0]["x"])

    class Sync(keras.callbacks.Callback):
        """Keras's fit deadlocks on 8 simulated CPU devices without a sync per batch."""

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            float((logs or {})["loss"])  # waits for the batch's step

    model.fit(x[: 2 * size], y[: 2 * size], batch_size=size, verbose=0, callbacks=[Sync()])

    def run() -> float:
        start = time.perf_counter()
        model.fit(x, y, batch_size=size, verbose=0, shuffle=False, callbacks=[Sync()])
        return (time.perf_counter() - start) / len(work.batches)

    return run


# -- the sections ---------------------------------------------------------------------------
def step_times(quick: bool) -> list[dict[str, Any]]:
    steps, rounds = (10, 1) if quick else (200, 5)
    rows = []
    # --quick checks that the script runs: the MLP alone (the GPT's compiles cost a minute).
    works = [mlp_workload(steps)] + ([] if quick else [gpt_workload(steps // 10, quick)])
    for work in works:
        for name in ("DataParallel",) if quick else ("DataParallel", "FSDP"):
            strategy = STRATEGIES[name]()
            loops = {
                **floor_loops(work, strategy),
                "Trainer.fit": trainer_loop(work, strategy),
                "Trainer.fit, track_norms=False": trainer_loop(work, strategy, track_norms=False),
                "nnx.jit loop (seed documents)": nnx_jit_loop(work, strategy),
            }
            if name == "DataParallel" and work.name.startswith("MLP"):
                keras = keras_loop(work)
                if keras is not None:
                    loops["Keras 3 fit, DataParallel"] = keras
            # The MLP's steps are short, so noise weighs more: twice the rounds.
            medians = interleaved(loops, rounds * 2 if work.name.startswith("MLP") else rounds)
            _, floor_seconds = floor(medians)
            for loop, seconds in medians.items():
                rows.append(
                    {
                        "workload": work.name,
                        "strategy": name,
                        "loop": loop,
                        "ms_per_step": seconds * 1e3,
                        "vs_floor": seconds / floor_seconds,
                    }
                )
    return rows


def memory(quick: bool) -> list[dict[str, Any]]:
    work = gpt_workload(2, quick)
    rows = []
    names = ("DataParallel", "FSDP") if quick else tuple(STRATEGIES)
    for name in names:
        make = STRATEGIES[name]
        trainer = Trainer(work.factory, optax.adam(1e-3), strategy=make(), loss_fn=work.loss_fn)
        table = sharding_table(trainer.state)
        per_device = sum(row["bytes_per_device"] for row in table)
        total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(trainer.state))
        lowered = trainer.plan.lower(work.batches[0], train_step=trainer.train_step)
        compiled = lowered.compile().memory_analysis()
        arguments = getattr(compiled, "argument_size_in_bytes", None)
        ideal = total / trainer.mesh.size
        rows.append(
            {
                "strategy": name,
                "state_bytes_per_device": per_device,
                "ideal": ideal,
                "vs_ideal": per_device / ideal,
                "compiled_argument_bytes": arguments,
            }
        )
    return rows


def checkpoints_and_input(quick: bool) -> list[dict[str, Any]]:
    import checkpoint_speed

    width, layers, rounds = (256, 1, 1) if quick else (2048, 4, 3)
    args = [f"--width={width}", f"--layers={layers}", f"--rounds={rounds}"]
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"checkpoint-{os.getpid()}.json"
    sys.argv = ["checkpoint_speed.py", *args, f"--json={out}"]
    checkpoint_speed.main()
    found = json.loads(out.read_text())
    out.unlink()
    rows = [{"measurement": k, "value": v} for k, v in found.get("ratios", {}).items()]
    work = gpt_workload(30 if not quick else 6, quick)
    trainer = Trainer(
        work.factory,
        optax.adam(1e-3),
        strategy=DataParallel(),
        loss_fn=work.loss_fn,
        log_every_n_steps=len(work.batches) // 2,
    )
    history = trainer.fit(work.batches, max_steps=len(work.batches))
    wait = history.history.get("perf/data_wait_fraction", [float("nan")])[-1]
    rows.append({"measurement": "share of step time waiting for input (GPT)", "value": wait})
    return rows


def versions() -> dict[str, str]:
    devices = f"{jax.device_count()} {jax.devices()[0].platform} devices"
    found = {
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {devices}",
    }
    for name in ("jax", "flax", "optax", "orbax-checkpoint", "keras"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def table(header: list[str], rows: list[list[Any]]) -> list[str]:
    def cell(value: Any) -> str:
        return f"{value:.3f}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]


def markdown(results: dict[str, Any]) -> str:
    described = ", ".join(f"{k} {v}" for k, v in results["versions"].items())
    lines = [f"Benchmarks of {results['date']} ({described})", ""]
    keys = ["workload", "strategy", "loop", "ms_per_step", "vs_floor"]
    lines += table(keys, [[r[k] for k in keys] for r in results["step_time"]])
    keys = ["strategy", "state_bytes_per_device", "ideal", "vs_ideal", "compiled_argument_bytes"]
    lines += ["", *table(keys, [[r[k] for k in keys] for r in results["memory"]])]
    keys = ["measurement", "value"]
    lines += ["", *table(keys, [[r[k] for k in keys] for r in results["checkpoints_and_input"]])]
    lines += [
        "",
        "Keras's fit runs with a callback that waits for each batch: without it, it "
        "deadlocks on 8 simulated CPU devices. The GPU figures (gpt2_small tokens/s and MFU) "
        "come from `benchmarks/gpu.py`, on a machine with a GPU.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks the script runs")
    args = parser.parse_args()
    results = {
        "date": datetime.date.today().isoformat(),
        "versions": versions(),
        "step_time": step_times(args.quick),
        "memory": memory(args.quick),
        "checkpoints_and_input": checkpoints_and_input(args.quick),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    table = markdown(results)
    (args.out / "results.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
