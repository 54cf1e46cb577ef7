"""Donation and prefetch on and off, per model, interleaved: the measurement behind the CPU
defaults of ``nnx_spmd_trainer/planner/backend_defaults.py``.

    python benchmarks/backend_defaults.py [--rounds 7] [--models mlp,gpt,minigpt]

Three models through ``Trainer.fit`` under the default job's layout
(``Hybrid(FSDP(4), TensorParallel(2))``, 8 simulated CPU devices), each with the
four settings ``prefetch`` in (0, 2) x ``donate`` in (False, True):

- ``mlp``: ``trainer_overhead.py``'s 64-256-10 MLP, Adam, batch 64 (what the
  defaults were first measured on);
- ``gpt``: the default job's GPT (2 x 128, 8 heads, ff 512, 64 tokens, vocab 1024,
  batch 32, AdamW);
- ``minigpt``: the JAX AI Stack miniGPT's sizes (8 x 256, 8 heads, ff 256, 256
  positions, vocab 50257 padded to 50304: ~29M parameters, ~350 MB of state with
  Adam's moments), fed few tokens (batch 8 x 32) so a step takes well under a
  second on 2 cores: the state is what donation acts on.

The machine is shared and noisy: a model's four variants take turns in every
round (the order rotating), and each ratio is the median of per-round ratios
(``floor.paired_ratio``), printed side by side. Writes nothing; the table of a run
is copied to ``benchmarks/results/backend_defaults.md``.
"""

from __future__ import annotations

import argparse
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
sys.path.insert(0, str(Path(__file__).parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from floor import Loss, interleaved_rounds, paired_ratio  # noqa: E402
from trainer_overhead import MLP  # noqa: E402
from trainer_overhead import batches as mlp_batches  # noqa: E402
from trainer_overhead import loss_fn as mlp_loss  # noqa: E402

from nnx_spmd_trainer import FSDP, Hybrid, Plan, TensorParallel, Trainer  # noqa: E402
from nnx_spmd_trainer.app import models  # noqa: E402

VARIANTS = [(prefetch, donate) for prefetch in (0, 2) for donate in (False, True)]


def token_batches(n: int, rows: int, seq: int, vocab: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        tokens = rng.integers(0, vocab, (rows, seq + 1)).astype(np.int32)
        out.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
    return out


def gpt(vocab: int, seq: int, width: int, heads: int, ff: int, layers: int) -> Callable:
    return lambda rngs: models.GPT(
        vocab_size=vocab,
        seq_len=seq,
        embed_dim=width,
        num_heads=heads,
        ff_dim=ff,
        num_layers=layers,
        dropout_rate=0.0,
        rngs=rngs,
        scan_layers=True,  # one layer compiled: the step's time is the same maths
    )


class Model:
    """A model, its loss, optimizer and batches; ``steps`` per timed call."""

    def __init__(
        self, factory: Callable, loss: Callable, tx: Any, data: list[dict], steps: int
    ) -> None:
        self.factory, self.loss, self.tx, self.data, self.steps = factory, loss, tx, data, steps


def build(name: str) -> Model:
    if name == "mlp":
        return Model(lambda r: MLP(r), mlp_loss, optax.adam(1e-3), mlp_batches(40), 40)
    if name == "gpt":  # configs/default.py's sizes
        factory = gpt(vocab=1024, seq=64, width=128, heads=8, ff=512, layers=2)
        data = token_batches(10, rows=32, seq=64, vocab=1024)
        return Model(factory, models.gpt.loss_fn, optax.adamw(3e-3), data, 10)
    if name == "minigpt":  # the JAX AI Stack tutorial's sizes, few tokens a step
        factory = gpt(vocab=50304, seq=256, width=256, heads=8, ff=256, layers=8)
        data = token_batches(3, rows=8, seq=32, vocab=50304)
        return Model(factory, models.gpt.loss_fn, optax.adamw(1e-3), data, 3)
    raise SystemExit(f"unknown model {name!r}: choose from mlp, gpt, minigpt")


def plan(model: Model, donate: bool) -> Plan:
    """The model's plan under the default job's layout: two trainers of one plan share its
    compiled step (prefetch changes no program; donation does)."""
    return Plan(
        model.factory,
        model.tx,
        strategy=Hybrid(FSDP(4), TensorParallel(2)),
        loss_fn=model.loss,
        metrics=Loss,
        donate=donate,
    )


def timed(model: Model, plans: dict[bool, Plan], prefetch: int, donate: bool) -> Callable:
    """Seconds per step of ``fit`` over the model's batches, compiled beforehand."""
    trainer = Trainer(plans[donate], prefetch=prefetch)
    trainer.fit(model.data[:1], max_steps=1)

    def run() -> float:
        start = time.perf_counter()
        trainer.fit(model.data, max_steps=trainer.step + model.steps)
        jax.block_until_ready(trainer.state)
        return (time.perf_counter() - start) / model.steps

    return run


def name(prefetch: int, donate: bool) -> str:
    return f"prefetch={prefetch} donate={'on' if donate else 'off'}"


def measure(model_name: str, rounds: int) -> dict[str, Any]:
    model = build(model_name)
    plans = {donate: plan(model, donate) for donate in (False, True)}
    loops = {name(p, d): timed(model, plans, p, d) for p, d in VARIANTS}
    times = interleaved_rounds(loops, rounds)
    del loops, plans  # each trainer's state goes before the next model's is built
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}

    def ratio(a: str, b: str) -> float:
        return paired_ratio(times[a], times[b])

    return {
        "ms": ms,
        "donate on/off @prefetch 0": ratio(name(0, True), name(0, False)),
        "donate on/off @prefetch 2": ratio(name(2, True), name(2, False)),
        "prefetch 2/0 @donate on": ratio(name(2, True), name(0, True)),
        "prefetch 2/0 @donate off": ratio(name(2, False), name(0, False)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--models", default="mlp,gpt,minigpt")
    args = parser.parse_args()
    print(
        f"devices={jax.device_count()} platform={jax.devices()[0].platform} "
        f"rounds={args.rounds} (ratios: median of per-round ratios; < 1: the first is faster)"
    )
    header = ["model"] + [name(p, d) + " ms" for p, d in VARIANTS]
    results = {}
    for model_name in args.models.split(","):
        start = time.perf_counter()
        results[model_name] = measure(model_name, args.rounds)
        print(f"# {model_name}: {time.perf_counter() - start:.0f} s", flush=True)
    ratio_keys = [k for k in next(iter(results.values())) if k != "ms"]
    print("| " + " | ".join(header + ratio_keys) + " |")
    print("|" + "---|" * (len(header) + len(ratio_keys)))
    for model_name, r in results.items():
        cells = [model_name] + [f"{r['ms'][name(p, d)]:.2f}" for p, d in VARIANTS]
        cells += [f"{r[k]:.3f}" for k in ratio_keys]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
