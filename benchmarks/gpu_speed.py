"""Speed on one GPU, in one run of at most ~8 minutes on an H100: issue 41's GPU numbers.

1. ``gpt2``: GPT-2 small (12 x 768) and medium (24 x 1024), 1024 tokens, batch 16,
   the shipped ``GPT`` in bf16 (fp32 master weights, cuDNN attention: ``attention.
   attention_implementation``), layers scanned (one layer compiled), AdamW, through
   ``Trainer.fit`` and through the fastest of ``floor.py``'s donating hand-written
   ``jax.jit`` loops on the same plan, interleaved: ms/step, tokens/s, MFU (``gpu.py``'s
   FLOPs count over the H100's 989.5 TFLOP/s bf16 peak) and the ratio trainer/hand-written.
2. ``pipeline``: ``PipelineParallel(S)`` with ``M`` microbatches (``pipeline_bubble.py``'s
   model), step time over the M = 4S one next to the GPipe prediction
   ``(M+S-1)/M`` over ``(5S-1)/4S``, and the bubble ``(S-1)/(M+S-1)``.
3. ``ring``: one attention layer, forward + backward, at 2k/8k/32k tokens (batch 1, 8
   heads of 64, bf16 on a GPU): the all-gather form (``causal_attention`` under
   ``SequenceParallel``) against ring attention with cuDNN blocks (``ring_attention``'s
   default there) and with einsum blocks, and the largest difference cuDNN/einsum.
4. ``moe``: ``moe_layouts.py``'s MoE GPT under its four expert layouts: state and peak
   bytes per device (``Plan.report``) and the median step time.
5. ``cache``: the compile cache: the same GPT-2 small ``Trainer.fit`` step in two fresh
   processes sharing a ``jax_compilation_cache_dir``: each one's compile time, its cache
   hits and misses (``planner.compile_cache.cache_counts``) and the cache's entries after it.

One H100 is one device: parts that need several (``pipeline``: S; ``moe``: 8; the ring
runs on as many GPUs as there are, one making it a one-device ring of two half-chunks,
whose all-gather form is plain cuDNN attention) run where there are too few GPUs on 8
devices of the host's CPU (``XLA_FLAGS`` below), and the output says which platform
each part ran on. Each part is written to ``gpu_speed.json`` / ``gpu_speed.md`` under
``--out`` as it ends, so a part that fails or runs out of time keeps those before it.
``--smoke`` runs tiny sizes on any backend (it checks the script; its numbers mean nothing).

The GPU image (PITFALLS.md) has jax 0.11.2 and flax but no grain, clu, tensorboardX or
ml_collections: bring them as wheels with the project's own. Once, here, in the repo root::

    echo /.whl/ >> .git/info/exclude
    .venv/bin/pip wheel --no-deps -w .whl .
    .venv/bin/python -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \\
        --platform manylinux2014_x86_64 -d .whl grain==0.2.18 clu==0.0.12 \\
        tensorboardX==2.6.5 ml_collections==1.1.0 array_record==0.8.6 portpicker==1.6.0

(the image lacks these and grain's array_record and portpicker; it has the rest: etils,
cloudpickle, protobuf, absl-py, tokenizers, safetensors, orbax-checkpoint),
then the device tool's ``run`` with ``carry=[".whl"]``, ``timeout_s=540`` and::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit;
    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_speed.py --out $OUT

(one line; ``--parts gpt2,ring`` runs a subset). On this CPU::

    .venv/bin/python benchmarks/gpu_speed.py --smoke --out /tmp/gpu_speed
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Multi-device parts fall back to the host's CPU devices: 8 of them. JAX_PLATFORMS=""
# keeps every platform (pipeline_bubble.py would otherwise pin the CPU).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "")
sys.path.insert(0, str(Path(__file__).parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import moe_layouts  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from floor import Loss, hand_written_loops, interleaved_rounds  # noqa: E402
from gpu import H100_BF16_PEAK, flops_per_token, token_batches  # noqa: E402
from run_all import table, versions  # noqa: E402

from nnx_spmd_trainer import (  # noqa: E402
    DataParallel,
    PipelineParallel,
    Plan,
    SequenceParallel,
    Trainer,
)
from nnx_spmd_trainer.app.models import GPT, gpt  # noqa: E402
from nnx_spmd_trainer.nn.attention import causal_attention  # noqa: E402
from nnx_spmd_trainer.nn.ring_attention import block_implementation, ring_attention  # noqa: E402
from nnx_spmd_trainer.planner.compile_cache import cache_counts  # noqa: E402

GPT2 = {
    "small": dict(vocab=50304, seq_len=1024, width=768, heads=12, ff=3072, layers=12, batch=16),
    "medium": dict(vocab=50304, seq_len=1024, width=1024, heads=16, ff=4096, layers=24, batch=16),
}
SMOKE_GPT = {"tiny": dict(vocab=128, seq_len=64, width=64, heads=4, ff=128, layers=2, batch=8)}
RING_TOKENS, SMOKE_RING_TOKENS = (2048, 8192, 32768), (64, 128)


def devices_for(count: int) -> list[Any]:
    """``count`` devices of the default backend, else of the host's CPU."""
    if len(jax.devices()) >= count:
        return jax.devices()[:count]
    return jax.devices("cpu")[:count]


def gpt_factory(size: dict[str, int], dtype: Any) -> Callable[[Any], GPT]:
    return lambda rngs: GPT(
        vocab_size=size["vocab"], seq_len=size["seq_len"], embed_dim=size["width"],
        num_heads=size["heads"], ff_dim=size["ff"], num_layers=size["layers"],
        dropout_rate=0.0, rngs=rngs, dtype=dtype, scan_layers=True,
    )  # fmt: skip


# -- 1. GPT-2 through Trainer.fit against a hand-written jax.jit loop ------------------------
def gpt2_part(sizes: dict[str, dict[str, int]], steps: int, rounds: int) -> list[dict]:
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    rows = []
    for name, size in sizes.items():
        data = token_batches(size, steps)

        def trainer(size: dict[str, int] = size) -> Trainer:
            return Trainer(
                gpt_factory(size, dtype), optax.adamw(6e-4), strategy=DataParallel(),
                loss_fn=gpt.loss_fn, metrics=Loss, log_every_n_steps=50,
            )  # fmt: skip

        fitted = trainer()
        fitted.fit(data[:2], max_steps=2)

        def fit(t: Trainer = fitted, data: list = data) -> float:
            start = time.perf_counter()
            t.fit(data, max_steps=t.step + len(data))
            jax.block_until_ready(t.state)
            return (time.perf_counter() - start) / len(data)

        hand = {k: v for k, v in hand_written_loops(trainer(), data, gpt.loss_fn).items()
                if "donating" in k}  # fmt: skip
        times = interleaved_rounds({"Trainer.fit": fit, **hand}, rounds)
        medians = {k: statistics.median(v) for k, v in times.items()}
        floor_name = min(hand, key=medians.__getitem__)
        per_round = [t / f for t, f in zip(times["Trainer.fit"], times[floor_name], strict=True)]
        tokens = size["batch"] * size["seq_len"]
        for loop in ("Trainer.fit", floor_name):
            rate = tokens / medians[loop]
            rows.append({
                "model": f"GPT-2 {name}", "dtype": jnp.dtype(dtype).name, "loop": loop,
                "ms_per_step": medians[loop] * 1e3, "tokens_per_s": rate,
                "mfu": flops_per_token(size) * rate / H100_BF16_PEAK,
                "trainer_over_hand": statistics.median(per_round),
            })  # fmt: skip
        del fitted, hand
    return rows


# -- 2. the pipeline bubble -----------------------------------------------------------------
def pipeline_part(stage_counts: tuple[int, ...], steps: int) -> list[dict]:
    from pipeline_bubble import batches, model

    def step_time(stages: int, micro: int) -> float:
        trainer = Trainer(
            model, optax.sgd(0.1), strategy=PipelineParallel(stages, microbatches=micro),
            loss_fn=gpt.loss_fn, devices=devices_for(stages),
        )  # fmt: skip
        data = batches(steps + 1)
        trainer.fit(data[:1], max_steps=1)
        start = time.perf_counter()
        trainer.fit(data[1:], max_steps=1 + steps)
        jax.block_until_ready(trainer.state)
        return (time.perf_counter() - start) / steps

    rows = []
    for s in stage_counts:
        timed = {m: step_time(s, m) for m in (s, 2 * s, 4 * s)}
        base_work = (5 * s - 1) / (4 * s)
        for m, seconds in timed.items():
            rows.append({
                "platform": devices_for(s)[0].platform, "S": s, "M": m,
                "bubble": (s - 1) / (m + s - 1), "ms_per_step": seconds * 1e3,
                "time_over_M4S": seconds / timed[4 * s],
                "predicted_over_M4S": (m + s - 1) / m / base_work,
            })  # fmt: skip
    return rows


# -- 3. ring against all-gather --------------------------------------------------------------
def ring_part(token_counts: tuple[int, ...], rounds: int) -> list[dict]:
    n = len(jax.devices())
    mesh = SequenceParallel(n).make_mesh(jax.devices())
    strategy = SequenceParallel(n)
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    heads, head_dim = 8, 64
    weights = np.cos(np.arange(head_dim)).astype(np.float32)

    def all_gather(q, k, v):  # type: ignore[no-untyped-def]
        with strategy.trace_context(mesh):
            return causal_attention(q, k, v)

    forms = {
        "all_gather": all_gather,
        "ring": lambda q, k, v: ring_attention(q, k, v, "seq"),
        "ring, einsum blocks": lambda q, k, v: ring_attention(q, k, v, "seq", blocks="einsum"),
    }
    rows = []
    for tokens in token_counts:
        rng = np.random.default_rng(0)
        shape = (1, tokens, heads, head_dim)
        split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "seq"))
        with jax.set_mesh(mesh):
            q, k, v = (jax.device_put(jnp.asarray(rng.normal(size=shape), dtype), split)
                       for _ in range(3))  # fmt: skip
            row: dict[str, Any] = {
                "platform": jax.devices()[0].platform, "devices": n, "tokens": tokens,
                "ring_blocks": block_implementation(dtype, head_dim, tokens // (2 * n)),
            }  # fmt: skip
            outs = {}
            timers = {}
            for name, attend in forms.items():

                def loss(q, k, v, attend=attend):  # type: ignore[no-untyped-def]
                    return (attend(q, k, v).astype(jnp.float32) * weights).sum()

                step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
                try:
                    jax.block_until_ready(step(q, k, v))
                    outs[name] = np.asarray(jax.jit(attend)(q, k, v), np.float32)
                except Exception as e:  # noqa: BLE001 (an OOM at 32k is a result)
                    row[f"{name} ms"] = f"failed: {type(e).__name__}: {str(e)[:80]}"
                    continue

                def timed(step=step, args=(q, k, v)) -> float:  # type: ignore[no-untyped-def]
                    start = time.perf_counter()
                    jax.block_until_ready(step(*args))
                    return time.perf_counter() - start

                timers[name] = timed
            for name, values in interleaved_rounds(timers, rounds).items():
                row[f"{name} ms"] = statistics.median(values) * 1e3
            if "ring" in outs and "ring, einsum blocks" in outs:
                row["max_abs_diff_ring_vs_einsum"] = float(
                    np.abs(outs["ring"] - outs["ring, einsum blocks"]).max()
                )
        rows.append(row)
    return rows


# -- 4. MoE layouts -----------------------------------------------------------------------------
def moe_part(steps: int) -> list[dict]:
    from clu import metrics as clu_metrics

    from nnx_spmd_trainer.nn.moe import moe_metrics

    experts, vocab, seq, batch = 8, 64, 64, 16

    def factory(rngs):  # type: ignore[no-untyped-def]
        return GPT(vocab_size=vocab, seq_len=seq, embed_dim=128, num_heads=4, ff_dim=512,
                   num_layers=2, dropout_rate=0.0, rngs=rngs, moe_experts=experts,
                   moe_every=1)  # fmt: skip

    metrics = clu_metrics.Collection.create(
        loss=clu_metrics.Average.from_output("loss"), **moe_metrics(experts)
    )
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, size=(steps + 1, batch, seq + 1)).astype(np.int32)
    data = [{"inputs": t[:, :-1], "targets": t[:, 1:]} for t in tokens]
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), data[0])
    layouts = moe_layouts.layouts()
    rows, mib = [], 2.0**20
    for name, strategy in layouts.items():
        plan = Plan(factory, optax.adamw(1e-3), strategy=strategy, loss_fn=gpt.loss_fn,
                    metrics=metrics, devices=devices_for(8))  # fmt: skip
        report = plan.report(shapes)
        trainer = Trainer(plan, track_norms=False)
        trainer.fit(data[:1], max_steps=1)
        start = time.perf_counter()
        trainer.fit(data[1:], max_steps=1 + steps)
        jax.block_until_ready(trainer.state)
        state = sum(report.bytes_per_device(k) for k in ("parameters", "optimizer"))
        rows.append({
            "layout": name, "platform": devices_for(8)[0].platform,
            "state_mib_per_device": state / mib, "peak_mib_per_device": report.memory["peak"] / mib,
            "all_to_all_mib": report.collectives["all-to-all"]["bytes"] / mib,
            "ms_per_step": (time.perf_counter() - start) / steps * 1e3,
        })  # fmt: skip
    return rows


# -- 5. the compile cache in a second process ---------------------------------------------------
def cache_child(cache_dir: str, size_name: str) -> None:
    """In a fresh process: build the GPT-2 Trainer, compile its step through a first ``fit``
    step with the persistent cache on, print the compile time as JSON."""
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    size = {**GPT2, **SMOKE_GPT}[size_name]
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    trainer = Trainer(gpt_factory(size, dtype), optax.adamw(6e-4), strategy=DataParallel(),
                      loss_fn=gpt.loss_fn, metrics=Loss)  # fmt: skip
    before = cache_counts()
    start = time.perf_counter()
    trainer.fit(token_batches(size, 1), max_steps=1)
    jax.block_until_ready(trainer.state)
    counted = cache_counts() - before
    print(json.dumps({"first_step_s": time.perf_counter() - start,
                      "compile_s": trainer.run.timings.compile_seconds,
                      "cache_hits": counted.hits, "cache_misses": counted.misses}))  # fmt: skip


def cache_part(size_name: str) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as cache_dir:
        for run in ("cold cache", "warm cache"):
            start = time.perf_counter()
            done = subprocess.run(
                [sys.executable, __file__, "--cache-child", cache_dir, "--cache-size", size_name],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            child = json.loads(done.stdout.strip().splitlines()[-1])
            entries = sum(1 for p in Path(cache_dir).rglob("*") if p.is_file())
            seconds = time.perf_counter() - start
            rows.append(
                {"process": run, "model": size_name, **child, "process_s": seconds,
                 "cache_entries": entries}
            )  # fmt: skip
    return rows


# -- the run -------------------------------------------------------------------------------------
def markdown(results: dict[str, Any]) -> str:
    described = ", ".join(f"{k} {v}" for k, v in results["versions"].items())
    lines = [f"GPU speed of {results['date']} ({described}); `{results['command']}`", ""]
    for part, rows in results["parts"].items():
        lines.append(f"## {part} ({results['seconds'].get(part, 0):.0f} s)")
        lines.append("")
        if isinstance(rows, str):
            lines += [rows, ""]
            continue
        keys = list(dict.fromkeys(k for row in rows for k in row))
        lines += [*table(keys, [[row.get(k, "") for k in keys] for row in rows]), ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--parts", default="gpt2,pipeline,ring,moe,cache")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, any backend")
    parser.add_argument("--steps", type=int, default=20, help="GPT-2 steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cache-child", help=argparse.SUPPRESS)
    parser.add_argument("--cache-size", default="small", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cache_child:
        cache_child(args.cache_child, args.cache_size)
        return
    if not args.smoke and jax.default_backend() != "gpu":
        parser.error(f"needs a GPU (JAX's backend is {jax.default_backend()}); try --smoke")
    smoke = args.smoke
    parts: dict[str, Callable[[], list[dict]]] = {
        "gpt2": lambda: gpt2_part(
            SMOKE_GPT if smoke else GPT2, 3 if smoke else args.steps, 1 if smoke else args.rounds
        ),  # fmt: skip
        "pipeline": lambda: pipeline_part((2,) if smoke else (2, 4), 2 if smoke else 5),
        "ring": lambda: ring_part(SMOKE_RING_TOKENS if smoke else RING_TOKENS, 1 if smoke else 3),
        "moe": lambda: moe_part(2 if smoke else 5),
        "cache": lambda: cache_part("tiny" if smoke else "small"),
    }
    results: dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "versions": versions(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "parts": {}, "seconds": {},
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.parts.split(","):
        start = time.perf_counter()
        try:
            results["parts"][name] = parts[name]()
        except Exception as e:  # noqa: BLE001 (the other parts still run and are written)
            results["parts"][name] = f"failed: {type(e).__name__}: {e}"
        results["seconds"][name] = time.perf_counter() - start
        print(f"# {name}: {results['seconds'][name]:.0f} s", flush=True)
        (args.out / "gpu_speed.json").write_text(json.dumps(results, indent=2) + "\n")
        (args.out / "gpu_speed.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
