"""The JAX AI Stack miniGPT through the ``Trainer`` against the tutorial's own loop, side by side.

    python benchmarks/minigpt_overhead.py [--layout tp|dp] [--steps 40] [--rounds 21]
        [--width 128] [--blocks 2] [--ff N] [--case small-vocab|tutorial-vocab]
        [--loops "tutorial|Trainer"] [--out benchmarks/results] [--quick]

A model the library did not write (``examples/port_minigpt.py``: the tutorial's
model, loss, optimizer and mesh), trained on the same batches in the same layout
by loops that take turns in every round (the order rotating), in one process:

- ``tutorial nnx.jit loop``: the tutorial's ``@nnx.jit train_step(model,
  optimizer, metrics, batch)``, each batch put on its mesh with ``jax.device_put``
  (at most two steps in flight, as the trainer: unbounded dispatch deadlocks
  8 simulated devices on 2 cores);
- ``hand-written jax.jit`` (donating, copying): the Flax performance guide's
  functional loop over split state (``floor.py``), placed inline;
- ``Trainer.fit``: with its defaults, with ``donate=False`` (the tutorial
  donates nothing) and with ``donate=True``.

Layouts: ``tp``, the tutorial's mesh (4 "batch" x 2 "model", the parameters split
as annotated); ``dp``, its 8-way data-parallel alternative (8 x 1). Before timing,
a fresh tutorial loop and a fresh trainer train the same batches and their losses
must agree to 1e-6. A ratio is the median of per-round ratios (``floor.paired_ratio``);
the spread is the 10th-90th percentile of those per-round ratios. ``--out`` writes
``minigpt_overhead.json`` and appends the run's table to ``minigpt_overhead.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Simulated CPU devices, and JAX kept on the CPU where no accelerator is (the tpu-plan
# extra's libtpu would start and print its warnings); a GPU or TPU machine is left as is.
from nnx_spmd_trainer.app.host_devices import simulate_host_devices  # noqa: E402

simulate_host_devices(8)
HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import port_minigpt as port  # noqa: E402
from flax import nnx  # noqa: E402
from floor import hand_written_loops, interleaved_rounds, paired_ratio  # noqa: E402
from jax.experimental import mesh_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from nnx_spmd_trainer import Trainer  # noqa: E402

LAYOUTS = {"tp": (4, 2), "dp": (8, 1)}
#: ``--case``: the sizes besides ``--width``/``--blocks``/``--ff``. ``tutorial-vocab``: the
#: tutorial's 50,257 ids with the rest shrunk for a CPU (issue 56: the embedding and head
#: are most of the parameters, as in small language models); ``--width 32 --ff 64`` with it.
CASES: dict[str, dict[str, int]] = {
    "small-vocab": {},  # port.TINY: 1,000 ids
    "tutorial-vocab": {"vocab_size": 50257, "num_heads": 4, "maxlen": 32, "batch_size": 8},
}
TUTORIAL = "tutorial nnx.jit loop"
TRAINER = "Trainer.fit (defaults)"


def use_layout(name: str) -> None:
    """Points the port's mesh (the tutorial's global ``mesh``) at ``LAYOUTS[name]``."""
    port.mesh = Mesh(mesh_utils.create_device_mesh(LAYOUTS[name]), ("batch", "model"))


def tutorial_loop(sizes: port.Sizes, batches: list) -> Callable[[], float]:
    """Seconds per step of the tutorial's loop over ``batches``, compiled beforehand; its
    metrics read every ``port.LOG_EVERY`` steps, as the ported trainer logs them."""
    model = port.create_model(sizes, nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
    batch_sharding = NamedSharding(port.mesh, P("batch", None))
    steps = 0

    def run() -> float:
        nonlocal steps
        start, pending = time.perf_counter(), []
        for batch in batches:
            port.train_step(model, optimizer, metrics, jax.device_put(batch, batch_sharding))
            steps += 1
            pending.append(optimizer.step[...])
            if len(pending) > 2:  # the trainer's default in-flight bound
                pending.pop(0).block_until_ready()
            if steps % port.LOG_EVERY == 0:
                float(metrics.compute()["loss"])
                metrics.reset()
        float(metrics.compute()["loss"])  # fit's last log point
        metrics.reset()
        return (time.perf_counter() - start) / len(batches)

    return run


def trainer_loop(trainer: Trainer, batches: list) -> Callable[[], float]:
    """Seconds per step of ``trainer.fit`` over ``batches``, compiled beforehand."""
    trainer.fit(batches[:2], max_steps=2)

    def run() -> float:
        start = time.perf_counter()
        trainer.fit(batches, max_steps=trainer.step + len(batches))
        jax.block_until_ready(trainer.state)
        return (time.perf_counter() - start) / len(batches)

    return run


def same_losses(sizes: port.Sizes, batches: list) -> float:
    """The largest relative difference between the tutorial loop's and the trainer's logged
    losses, each trained fresh on ``batches``; raises above 1e-6."""
    old, new = port.tutorial_loop(sizes, batches), port.trainer_loop(sizes, batches)
    # Relative: the layouts sum in other orders than one device, and Adam turns the float
    # noise on the attention's key bias (whose true gradient is 0) into lr-sized steps.
    difference = float(np.max(np.abs(np.subtract(old, new)) / np.abs(old)))
    if len(old) != len(new) or difference > 1e-6:
        raise SystemExit(f"the losses differ: tutorial {old}, trainer {new}")
    return difference


def same_layout(trainer: Trainer, sizes: port.Sizes, batch: Any) -> None:
    """Raises unless the trainer's parameters are laid out as the tutorial's model trains:
    after one of its ``nnx.jit`` steps on ``batch``. Its unannotated embeddings are born on
    one device and take the layout XLA gives their update (their features over "model"),
    which ``TensorParallel`` gives a large unannotated matrix."""

    def specs(module: nnx.Module) -> Any:
        def spec(x: jax.Array) -> tuple:
            entries = tuple(getattr(x.sharding, "spec", ()))
            while entries and entries[-1] is None:
                entries = entries[:-1]
            return entries

        return jax.tree.map(spec, nnx.state(module, nnx.Param))

    model = port.create_model(sizes, nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
    placed = jax.device_put(batch, NamedSharding(port.mesh, P("batch", None)))
    port.train_step(model, optimizer, metrics, placed)
    mine, theirs = specs(trainer.model), specs(model)
    if mine != theirs:
        raise SystemExit(f"the trainer's layout is not the tutorial's: {mine} vs {theirs}")


def with_cpu(run: Callable[[], float], steps: int) -> Callable[[], tuple[float, float]]:
    """``run`` returning (wall seconds, process CPU seconds) per step: the CPU devices are
    the host's cores, so CPU time is what the loop costs the machine, whatever its load."""

    def timed() -> tuple[float, float]:
        start = time.process_time()
        wall = run()
        return wall, (time.process_time() - start) / steps

    return timed


def spread(ratios: list[float]) -> tuple[float, float]:
    """The 10th and 90th percentiles of ``ratios``."""
    low, *_, high = statistics.quantiles(ratios, n=10) if len(ratios) > 1 else ratios * 2
    return low, high


def measure(args: argparse.Namespace) -> dict[str, Any]:
    use_layout(args.layout)
    sizes = dataclasses.replace(
        port.TINY,
        embed_dim=args.width,
        feed_forward_dim=args.ff or args.width,
        num_transformer_blocks=args.blocks,
        steps=args.steps,
        **{k: v for k, v in CASES[args.case].items() if k not in ("embed_dim", "blocks")},
    )
    batches = port.token_batches(sizes)
    checked = dataclasses.replace(sizes, steps=2 * port.LOG_EVERY)
    difference = same_losses(checked, port.token_batches(checked))
    trainer = port.ported_trainer(sizes)
    same_layout(trainer, sizes, batches[0])
    loops = {
        TUTORIAL: tutorial_loop(sizes, batches),
        TRAINER: trainer_loop(trainer, batches),
        "Trainer.fit (donate=False)": trainer_loop(
            port.ported_trainer(sizes, donate=False), batches
        ),
        "Trainer.fit (donate=True)": trainer_loop(port.ported_trainer(sizes, donate=True), batches),
    }
    hand = hand_written_loops(trainer, batches, port.loss_fn)
    loops.update({name: run for name, run in hand.items() if "placed inline" in name})
    if args.loops:
        wanted = [TUTORIAL, *args.loops.split("|")]  # the names hold commas; ratios need it
        loops = {name: run for name, run in loops.items() if name.startswith(tuple(wanted))}
    rounds = interleaved_rounds(
        {name: with_cpu(run, len(batches)) for name, run in loops.items()}, args.rounds
    )
    rows = []
    for name, values in rounds.items():
        row: dict[str, Any] = {"loop": name}
        for i, clock in enumerate(("wall", "cpu")):
            times = [v[i] for v in values]
            base = [v[i] for v in rounds[TUTORIAL]]
            low, high = spread([t / b for t, b in zip(times, base, strict=True)])
            row[f"{clock}_ms_per_step"] = round(statistics.median(times) * 1e3, 3)
            row[f"{clock}_vs_tutorial"] = round(paired_ratio(times, base), 3)
            row[f"{clock}_spread_p10_p90"] = [round(low, 3), round(high, 3)]
        rows.append(row)
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python benchmarks/minigpt_overhead.py " + " ".join(sys.argv[1:]),
        "devices": jax.device_count(),
        "platform": jax.devices()[0].platform,
        "layout": f"{args.layout} {LAYOUTS[args.layout]} ('batch', 'model')",
        "sizes": dataclasses.asdict(sizes) | {"padded_vocab": sizes.padded_vocab},
        "rounds": args.rounds,
        "loss_difference": difference,
        "load_average": os.getloadavg(),
        "rows": rows,
    }


def table(result: dict[str, Any]) -> str:
    s = result["sizes"]
    lines = [
        f"### {result['date']}: layout {result['layout']}, {result['rounds']} rounds",
        "",
        f"`{result['command']}`; {s['num_transformer_blocks']} blocks x {s['embed_dim']}, "
        f"ff {s['feed_forward_dim']}, {s['num_heads']} heads, {s['maxlen']} tokens, vocab "
        f"{s['padded_vocab']}, batch {s['batch_size']}, {s['steps']} steps a round; losses "
        f"equal to {result['loss_difference']:.1e} (relative); load average "
        f"{', '.join(f'{x:.1f}' for x in result['load_average'])}.",
        "",
        "| loop | wall ms/step | wall vs tutorial | spread p10-p90 "
        "| CPU ms/step | CPU vs tutorial | spread p10-p90 |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        cells = [row["loop"]]
        for clock in ("wall", "cpu"):
            low, high = row[f"{clock}_spread_p10_p90"]
            cells += [
                f"{row[f'{clock}_ms_per_step']:.2f}",
                f"{row[f'{clock}_vs_tutorial']:.3f}",
                f"{low:.3f}-{high:.3f}",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="tp")
    parser.add_argument("--steps", type=int, default=40, help="steps a round")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--width", type=int, default=128, help="embed_dim = ff dim")
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--ff", type=int, help="feed-forward width (default: --width)")
    parser.add_argument("--case", choices=sorted(CASES), default="small-vocab")
    parser.add_argument("--loops", help="loops to time: '|'-separated name prefixes (default: all)")
    parser.add_argument("--out", type=Path, help="write minigpt_overhead.json/.md here")
    parser.add_argument("--quick", action="store_true", help="tiny: the script runs, no more")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds, args.width, args.blocks = 4, 1, 32, 1
    result = measure(args)
    text = table(result)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "minigpt_overhead.json").write_text(json.dumps(result, indent=2) + "\n")
        with (args.out / "minigpt_overhead.md").open("a") as md:
            md.write("\n" + text)


if __name__ == "__main__":
    main()
