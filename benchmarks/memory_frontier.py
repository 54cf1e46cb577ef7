"""Memory per device of a GPT train step: remat policies, the chunked loss, the deepest model.

Every figure is the compiled train step's own ``memory_analysis()`` per device,
through ``Plan(...).report(shapes)``: no array is built and no step runs. 8
simulated CPU devices, ``Hybrid(FSDP(4), TensorParallel(2))`` (the default
job's layout), fp32, AdamW, the default config's GPT width (128, 8 heads,
feed-forward 512), the blocks scanned (``scan_layers=True``: one layer is
compiled whatever the depth).

a. Remat policy -> temporaries per device, 8 layers at sequence 256, the
   default job's batch (32) and vocabulary (the text's 103 characters padded
   to 104); each ``remat.POLICIES`` entry the CPU runs, per block
   (``GPT(remat=...)``) and around the whole loss (``Plan(remat=...)``).
b. The chunked loss (``gpt.chunked_loss_fn``, through ``chunked_cross_entropy``)
   against the plain one (``gpt.loss_fn``) at GPT-2's vocabulary (50304):
   temporaries, peak, their ratio.
c. The frontier: the deepest GPT whose step fits a per-device budget (peak =
   arguments + outputs - donated + temporaries, as ``Plan.report`` counts
   it), for no remat, full remat and dots_saveable per block, with and
   without the chunked loss. The depth is found by extrapolating the peak
   from two depths, then bracketing and bisecting with real compiles.

XLA's CPU code generation runs at optimisation level 0 here (compiles ~40%
faster on this machine): buffer assignment, and so every byte reported, comes
before it (checked: the same bytes for a full-remat GPT at 1 and 9 layers).

    python benchmarks/memory_frontier.py [--quick] [--out FILE.md]
"""

import argparse
import dataclasses
import functools
import os
import time
from collections.abc import Callable, Sequence

_flags = os.environ.get("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
if "xla_backend_optimization_level" not in _flags:  # faster compiles, the same bytes
    _flags += " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ["XLA_FLAGS"] = _flags
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from nnx_spmd_trainer import (  # noqa: E402
    FSDP,
    Hybrid,
    Plan,
    TensorParallel,
    remat,
)
from nnx_spmd_trainer.app.models import GPT, gpt  # noqa: E402
from nnx_spmd_trainer.planner.plan_report import PlanReport, size  # noqa: E402

MiB = 2**20


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The shapes of one run of the benchmark (``FULL`` or ``QUICK``)."""

    width: int
    heads: int
    ff: int
    batch: int  # global rows
    seq: int
    char_vocab: int  # part a
    big_vocab: int  # parts b and c
    remat_layers: int  # part a
    loss_layers: int  # part b
    chunk: int  # positions per chunk of the chunked loss
    frontier_batch: int
    budget: int  # bytes per device, part c
    max_layers: int  # part c searches depths 1..max_layers
    probes: tuple[int, int]  # part c extrapolates the peak from these two depths
    policies: tuple[str, ...] | None  # part a; None: every policy the CPU runs
    frontier_rows: tuple[tuple[str, bool], ...]  # part c: (remat per block, chunked loss)


FULL = Sizes(
    width=128, heads=8, ff=512, batch=32, seq=256, char_vocab=104, big_vocab=50304,
    remat_layers=8, loss_layers=2, chunk=32, frontier_batch=8, budget=512 * MiB,
    max_layers=4096, probes=(4, 12), policies=None,
    frontier_rows=tuple((p, c) for p in ("none", "full", "dots_saveable") for c in (False, True)),
)  # fmt: skip
# Tiny, and shaped so the parts share compiles (report() is cached): a smoke run.
QUICK = Sizes(
    width=32, heads=4, ff=64, batch=8, seq=32, char_vocab=1024, big_vocab=1024,
    remat_layers=2, loss_layers=2, chunk=8, frontier_batch=8, budget=4 * MiB,
    max_layers=64, probes=(1, 2), policies=("none", "full"), frontier_rows=(("none", True),),
)  # fmt: skip


def strategy() -> Hybrid:
    return Hybrid(FSDP(4), TensorParallel(2))


def batch_shapes(rows: int, seq: int) -> dict[str, jax.ShapeDtypeStruct]:
    return {name: jax.ShapeDtypeStruct((rows, seq), jnp.int32) for name in ("inputs", "targets")}


@functools.cache
def report(
    sizes: Sizes,
    *,
    layers: int,
    vocab: int,
    rows: int,
    chunked: bool = False,
    block_remat: str = "none",
    loss_remat: str = "none",
) -> PlanReport:
    """``Plan.report`` of one GPT train step: compiled, nothing built."""

    def model(rngs):
        return GPT(
            vocab_size=vocab, seq_len=sizes.seq, embed_dim=sizes.width, num_heads=sizes.heads,
            ff_dim=sizes.ff, num_layers=layers, dropout_rate=0.0, rngs=rngs,
            scan_layers=True, remat=block_remat,
        )  # fmt: skip

    loss_fn = functools.partial(gpt.chunked_loss_fn, chunk_size=sizes.chunk)
    plan = Plan(
        model,
        optax.adamw(1e-3),
        strategy=strategy(),
        loss_fn=loss_fn if chunked else gpt.loss_fn,
        remat=loss_remat,
    )
    return plan.report(batch_shapes(rows, sizes.seq))


def cpu_policies() -> list[str]:
    """The names in ``remat.POLICIES`` this backend runs (offloading needs a host memory)."""
    runnable = []
    for name in remat.POLICIES:
        try:
            remat.checkpoint_policy(name)
        except ValueError:
            continue
        runnable.append(name)
    return runnable


def markdown(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def remat_table(sizes: Sizes) -> str:
    """Part a: temporaries per device per policy, per block and around the whole loss."""
    policies = list(sizes.policies) if sizes.policies else cpu_policies()
    common = {"layers": sizes.remat_layers, "vocab": sizes.char_vocab, "rows": sizes.batch}
    base = report(sizes, **common).memory["temporaries"]
    rows = []
    for name in policies:
        # An alias ("full" is nothing_saveable) compiles as the name it stands for.
        same = next(other for other in policies if remat.POLICIES[other] is remat.POLICIES[name])
        block = report(sizes, block_remat=same, **common).memory["temporaries"]
        whole = report(sizes, loss_remat=same, **common).memory["temporaries"]
        rows.append([name, size(block), f"{block / base:.2f}", size(whole), f"{whole / base:.2f}"])
    title = (
        f"### a. Remat policy: temporaries per device\n\nGPT {sizes.remat_layers} layers x "
        f"{sizes.width} (heads {sizes.heads}, ff {sizes.ff}), vocabulary {sizes.char_vocab}, "
        f"batch {sizes.batch} x {sizes.seq} tokens, AdamW, {strategy()!r} on 8 devices.\n\n"
    )
    header = ["policy", "per block", "per block / none", "whole loss", "whole loss / none"]
    return title + markdown(header, rows)


def loss_table(sizes: Sizes) -> str:
    """Part b: the chunked loss against the plain one at a large vocabulary."""
    common = {"layers": sizes.loss_layers, "vocab": sizes.big_vocab, "rows": sizes.batch}
    plain, chunked = report(sizes, **common), report(sizes, chunked=True, **common)
    rows = []
    for name, r in (
        ("plain (gpt.loss_fn)", plain),
        (f"chunked (chunk_size={sizes.chunk})", chunked),
    ):
        temp, peak = r.memory["temporaries"], r.memory["peak"]
        rows.append([name, size(temp), size(peak)])
    ratio_temp = chunked.memory["temporaries"] / plain.memory["temporaries"]
    ratio_peak = chunked.memory["peak"] / plain.memory["peak"]
    rows.append(["ratio chunked / plain", f"{ratio_temp:.3f}", f"{ratio_peak:.3f}"])
    logits = sizes.batch // 4 * sizes.seq * sizes.big_vocab // 2 * 4
    title = (
        f"### b. Chunked vs plain loss at vocabulary {sizes.big_vocab}\n\nGPT "
        f"{sizes.loss_layers} layers x {sizes.width}, batch {sizes.batch} x {sizes.seq} "
        f"tokens, AdamW, {strategy()!r}; one device's fp32 logits are {size(logits)}.\n\n"
    )
    return title + markdown(["loss", "temporaries / device", "peak / device"], rows)


def largest_fitting(fits: Callable[[int], bool], guess: int, limit: int) -> int:
    """The largest ``n`` in ``[0, limit]`` with ``fits(n)`` (``fits`` monotone, ``fits(0)``
    taken as true): gallop from ``guess`` to bracket the edge, then bisect."""
    lo, hi = 0, limit + 1  # fits(lo), not fits(hi)
    probe = min(max(guess, 1), limit)
    step = 1
    if fits(probe):
        lo = probe
        while lo + step <= limit and fits(lo + step):
            lo, step = lo + step, step * 2
        hi = min(lo + step, limit + 1)
    else:
        hi = probe
        while hi - step >= 1 and not fits(hi - step):
            hi, step = hi - step, step * 2
        lo = max(hi - step, 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def frontier(sizes: Sizes, *, block_remat: str, chunked: bool) -> tuple[int, int, int]:
    """``(depth, peak, depths tried)``: the deepest GPT that fits ``sizes.budget`` and its
    peak per device (when not even one layer fits: depth 0 and one layer's peak)."""
    peaks: dict[int, int] = {}

    def peak(layers: int) -> int:
        if layers not in peaks:
            peaks[layers] = report(
                sizes, layers=layers, vocab=sizes.big_vocab, rows=sizes.frontier_batch,
                chunked=chunked, block_remat=block_remat,
            ).memory["peak"]  # fmt: skip
        return peaks[layers]

    # The peak grows about linearly with depth: extrapolate from two depths for a guess.
    first, second = sizes.probes
    slope = max((peak(second) - peak(first)) / (second - first), 1.0)
    guess = second + int((sizes.budget - peak(second)) // slope)
    depth = largest_fitting(lambda n: peak(n) <= sizes.budget, guess, sizes.max_layers)
    return depth, peak(max(depth, 1)), len(peaks)


def frontier_table(sizes: Sizes) -> str:
    """Part c: the deepest GPT within the budget, per remat policy and loss."""
    rows = []
    for policy, chunked in sizes.frontier_rows:
        depth, peak, compiles = frontier(sizes, block_remat=policy, chunked=chunked)
        loss = f"chunked ({sizes.chunk})" if chunked else "plain"
        limit = f">= {depth}" if depth == sizes.max_layers else str(depth)
        shown = size(peak) if depth else f"(1 layer: {size(peak)})"
        rows.append([policy, loss, limit, shown, compiles])
    title = (
        f"### c. The deepest GPT within {size(sizes.budget)} per device\n\nWidth "
        f"{sizes.width} (heads {sizes.heads}, ff {sizes.ff}), vocabulary {sizes.big_vocab}, "
        f"batch {sizes.frontier_batch} x {sizes.seq} tokens, AdamW, {strategy()!r}, "
        f"blocks scanned, remat per block; depths 1..{sizes.max_layers} searched; peak = "
        "arguments + outputs - donated + temporaries per device (Plan.report).\n\n"
    )
    return title + markdown(["remat", "loss", "layers", "peak / device", "depths tried"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--out", help="also write the tables to this Markdown file")
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    start = time.perf_counter()
    devices = jax.devices()
    command = "python benchmarks/memory_frontier.py" + (" --quick" if args.quick else "")
    intro = (
        f"## Memory frontier\n\n`{command}`: {devices[0].platform}, {len(devices)} devices; "
        f"jax {jax.__version__}; every figure from the compiled step's memory_analysis() "
        "(Plan.report), no array built."
    )
    print(intro, flush=True)
    tables = [intro]
    for part in (remat_table, loss_table, frontier_table):
        tables.append(part(sizes))
        print("\n" + tables[-1], flush=True)
    tables.append(f"({time.perf_counter() - start:.0f} s)")
    print(tables[-1])
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n\n".join(tables) + "\n")


if __name__ == "__main__":
    main()
