"""On one GPU: GPT-2 small through the Trainer against a hand-written limit, and step overhead.

    python benchmarks/gpu.py [--out benchmarks/results] [--steps 100] [--rounds 3]
                             [--batch 16 32] [--quick]

1. GPT-2 small (``configs/gpt2_small.py``: 12 x 768, 12 heads, 1024 tokens,
   vocabulary 50304, batch 16, AdamW), tokens/s and MFU, side by side:
   * the limit: a hand-written GPT-2 in plain JAX (a dict of fp32 master
     weights cast to bf16 in the step, ``jax.nn.dot_product_attention`` with
     ``implementation="cudnn"``, ``optax.adamw``, ``jax.jit`` with donation);
   * the floor: the shipped ``GPT`` in bf16 in a hand-written ``jax.jit`` loop
     (what the model costs without the Trainer);
   * ``Trainer.fit`` with the shipped ``GPT`` in bf16 and in fp32, logging
     every 50 steps as the configs do (the norms are computed on those steps).
   MFU = model FLOPs per token x tokens/s / 989.5e12 (H100 SXM bf16 dense),
   FLOPs per token = 6 x matmul parameters (head included, embedding tables
   excluded) + 12 x layers x width x seq_len (nanoGPT's count; PITFALLS.md).
2. The small MLP step (as ``run_all.py``) on one GPU: ``Trainer.fit`` against the
   hand-written ``jax.jit`` floor and the seed documents' ``nnx.jit`` loop.

Timings are medians over interleaved rounds after a warm-up, and ratios are
to loops measured in the same run. Writes ``gpu.md`` and ``gpu.json`` to ``--out``.
``--quick`` runs tiny sizes on whatever backend there is (its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from floor import floor  # noqa: E402
from run_all import (  # noqa: E402
    Workload,
    floor_loops,
    interleaved,
    mlp_workload,
    nnx_jit_loop,
    table,
    trainer_loop,
    versions,
)

from nnx_spmd_trainer import DataParallel  # noqa: E402
from nnx_spmd_trainer.app.models import GPT, gpt  # noqa: E402

H100_BF16_PEAK = 989.5e12
GPT2_SMALL = dict(vocab=50304, seq_len=1024, width=768, heads=12, ff=3072, layers=12, batch=16)
TINY = dict(vocab=128, seq_len=64, width=64, heads=4, ff=128, layers=2, batch=8)


def flops_per_token(size: dict[str, int]) -> float:
    width, layers = size["width"], size["layers"]
    matmul = layers * (4 * width * width + 2 * width * size["ff"]) + width * size["vocab"]
    return 6.0 * matmul + 12.0 * layers * width * size["seq_len"]


def token_batches(size: dict[str, int], steps: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    shape = (steps, size["batch"], size["seq_len"] + 1)
    tokens = rng.integers(0, size["vocab"], shape).astype(np.int32)
    return [{"inputs": t[:, :-1], "targets": t[:, 1:]} for t in tokens]


def gpt_workload(size: dict[str, int], dtype: Any, steps: int) -> Workload:
    def factory(rngs: Any) -> GPT:
        return GPT(
            vocab_size=size["vocab"],
            seq_len=size["seq_len"],
            embed_dim=size["width"],
            num_heads=size["heads"],
            ff_dim=size["ff"],
            num_layers=size["layers"],
            dropout_rate=0.0,
            rngs=rngs,
            dtype=dtype,
        )

    name = f"shipped GPT {jnp.dtype(dtype).name}"
    return Workload(
        name, factory, gpt.loss_fn, token_batches(size, steps), lambda: optax.adamw(6e-4)
    )


def handwritten_limit(size: dict[str, int], steps: int) -> Callable[[], float]:
    """GPT-2 in plain JAX: fp32 master weights, bf16 compute, cuDNN attention on a GPU."""
    vocab, seq_len, width, heads, ff, layers = (
        size[k] for k in ("vocab", "seq_len", "width", "heads", "ff", "layers")
    )
    keys = iter(jax.random.split(jax.random.key(0), 8 * layers + 8))

    def dense(fan_in: int, fan_out: int) -> jax.Array:
        scale = (2.0 / (fan_in + fan_out)) ** 0.5
        return jax.random.normal(next(keys), (fan_in, fan_out), jnp.float32) * scale

    def norm() -> tuple[jax.Array, jax.Array]:
        return jnp.ones(width), jnp.zeros(width)

    params = {
        "wte": jax.random.normal(next(keys), (vocab, width)) * 0.02,
        "wpe": jax.random.normal(next(keys), (seq_len, width)) * 0.02,
        "ln_f": norm(),
        "head": dense(width, vocab),
        "head_b": jnp.zeros(vocab),
        "blocks": [
            {
                "ln1": norm(),
                "qkv": dense(width, 3 * width),
                "qkv_b": jnp.zeros(3 * width),
                "proj": dense(width, width),
                "proj_b": jnp.zeros(width),
                "ln2": norm(),
                "fc": dense(width, ff),
                "fc_b": jnp.zeros(ff),
                "out": dense(ff, width),
                "out_b": jnp.zeros(width),
            }
            for _ in range(layers)
        ],
    }
    implementation = gpt.attention_implementation(jnp.bfloat16)

    def layer_norm(x: jax.Array, scale_bias: tuple[jax.Array, jax.Array]) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean, var = x32.mean(-1, keepdims=True), x32.var(-1, keepdims=True)
        scale, bias = scale_bias
        return ((x32 - mean) * jax.lax.rsqrt(var + 1e-6) * scale + bias).astype(jnp.bfloat16)

    def forward(params: Any, tokens: jax.Array) -> jax.Array:
        p = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
        batch, length = tokens.shape
        x = p["wte"][tokens] + p["wpe"][:length]
        for b in p["blocks"]:
            qkv = layer_norm(x, b["ln1"]) @ b["qkv"] + b["qkv_b"]
            q, k, v = (t.reshape(batch, length, heads, -1) for t in jnp.split(qkv, 3, axis=-1))
            attended = jax.nn.dot_product_attention(
                q, k, v, is_causal=True, implementation=implementation
            )
            x = x + attended.reshape(batch, length, width) @ b["proj"] + b["proj_b"]
            hidden = jax.nn.gelu(layer_norm(x, b["ln2"]) @ b["fc"] + b["fc_b"])
            x = x + hidden @ b["out"] + b["out_b"]
        return (layer_norm(x, p["ln_f"]) @ p["head"] + p["head_b"]).astype(jnp.float32)

    def loss_fn(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
        logits = forward(params, batch["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    tx = optax.adamw(6e-4)

    @jax.jit
    def init(params: Any) -> tuple[Any, Any]:
        return params, tx.init(params)

    def step(params: Any, opt_state: Any, batch: dict) -> tuple[Any, Any, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    jitted = jax.jit(step, donate_argnums=(0, 1))
    batches = token_batches(size, steps)
    state = init(params)

    def run() -> float:
        nonlocal state
        params, opt_state = state
        params, opt_state, loss = jitted(params, opt_state, jax.device_put(batches[0]))
        loss.block_until_ready()
        start, pending = time.perf_counter(), []
        for batch in batches:
            params, opt_state, loss = jitted(params, opt_state, jax.device_put(batch))
            pending.append(loss)
            if len(pending) > 2:
                pending.pop(0).block_until_ready()
        jax.block_until_ready((params, loss))
        state = (params, opt_state)
        return (time.perf_counter() - start) / len(batches)

    return run


def gpt2(size: dict[str, int], steps: int, rounds: int) -> list[dict[str, Any]]:
    bf16, fp32 = gpt_workload(size, jnp.bfloat16, steps), gpt_workload(size, jnp.float32, steps)
    strategy = DataParallel()
    loops: dict[str, Callable[[], float]] = {
        "hand-written GPT-2, bf16 + cuDNN attention (limit)": handwritten_limit(size, steps),
        **floor_loops(bf16, strategy),  # the shipped GPT in bf16, four ways
        "Trainer.fit, shipped GPT bf16": trainer_loop(bf16, strategy),
    }
    if size["batch"] <= 16:  # fp32 attention is XLA's, and its scores need 55 GB at batch 32
        loops["Trainer.fit, shipped GPT fp32"] = trainer_loop(fp32, strategy)
    medians = interleaved(loops, rounds)
    limit = medians["hand-written GPT-2, bf16 + cuDNN attention (limit)"]
    _, fastest = floor(medians)
    tokens = size["batch"] * size["seq_len"]
    rows = []
    for loop, seconds in medians.items():
        rate = tokens / seconds
        rows.append(
            {
                "loop": loop,
                "ms_per_step": seconds * 1e3,
                "tokens_per_s": rate,
                "mfu": flops_per_token(size) * rate / H100_BF16_PEAK,
                "vs_limit": seconds / limit,
                "vs_floor": seconds / fastest,
            }
        )
    return rows


def mlp(steps: int, rounds: int) -> list[dict[str, Any]]:
    work, strategy = mlp_workload(steps), DataParallel()
    loops = {
        **floor_loops(work, strategy),
        "Trainer.fit": trainer_loop(work, strategy),
        "Trainer.fit, track_norms=False": trainer_loop(work, strategy, track_norms=False),
        "nnx.jit loop (seed documents)": nnx_jit_loop(work, strategy),
    }
    medians = interleaved(loops, rounds)
    _, fastest = floor(medians)
    return [
        {"loop": k, "ms_per_step": v * 1e3, "vs_floor": v / fastest} for k, v in medians.items()
    ]


def markdown(results: dict[str, Any]) -> str:
    described = ", ".join(f"{k} {v}" for k, v in results["versions"].items())
    lines = [f"GPU benchmarks of {results['date']} ({described})", ""]
    keys = ["loop", "ms_per_step", "tokens_per_s", "mfu", "vs_limit", "vs_floor"]
    for run in results["gpt2"]:
        lines += [f"GPT-2 small ({run['size']}):", ""]
        lines += [*table(keys, [[r[k] for k in keys] for r in run["rows"]]), ""]
    keys = ["loop", "ms_per_step", "vs_floor"]
    lines += ["Small MLP (64-256-10, batch 64), DataParallel:", ""]
    lines += table(keys, [[r[k] for k in keys] for r in results["mlp"]])
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--steps", type=int, default=100, help="GPT-2 steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--batch", type=int, nargs="+", default=[GPT2_SMALL["batch"]], help="GPT-2 batch sizes"
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks the script runs")
    args = parser.parse_args()
    if not args.quick and jax.default_backend() != "gpu":
        backend = jax.default_backend()
        parser.error(f"needs a GPU (JAX's backend is {backend}); --quick runs tiny sizes anywhere")
    size, steps, rounds = (TINY, 3, 1) if args.quick else (GPT2_SMALL, args.steps, args.rounds)
    sizes = [size] if args.quick else [{**size, "batch": batch} for batch in args.batch]
    results: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "versions": versions(),
        "gpt2": [],
        "mlp": [],
    }
    args.out.mkdir(parents=True, exist_ok=True)

    def write() -> None:  # after each measurement: a later failure keeps the earlier ones
        (args.out / "gpu.json").write_text(json.dumps(results, indent=2) + "\n")
        (args.out / "gpu.md").write_text(markdown(results))

    for s in sizes:
        described = ", ".join(f"{k} {v}" for k, v in s.items())
        results["gpt2"].append({"size": described, "rows": gpt2(s, steps, rounds)})
        write()
    results["mlp"] = mlp(10 if args.quick else 200, rounds)
    write()
    print(markdown(results))


if __name__ == "__main__":
    main()
