"""Plans for TPU pods that are not here: the TPU compiler's memory verdict and a roofline
step time for GPT sizes on v5e-16, v5p-64 and v6e-256, from this CPU (issue 55).

Each cell is ``Plan(..., target=...)`` compiled by libtpu's compiler (no chip, no array):
fits or not, the peak per chip against the chip's HBM, the step-time bound
(``target_report.roofline``: the largest of compute, HBM, ICI and DCN time, each from
Google's published per-chip figures), and the largest global batch that fits (doubling,
then bisection: ``target_choice.largest_batch``).

Models (shapes only, no weights; the shipped GPT with ``scan_layers=True``, bf16
compute, float32 parameters, AdamW, the chunked loss, 1024 positions): GPT-2 small,
medium and large, and a GPT of Qwen3-8B's sizes (151,936 ids, 4096 wide, 32 heads,
12,288 feed-forward, 36 layers: multi-head attention and a GELU MLP in place of
Qwen3's grouped-query attention and SwiGLU, so 7.4B parameters, not 8.2B).
Layouts: ``FSDP()`` and ``Hybrid(FSDP(), TensorParallel(4))``.

Run one process per target (they write JSON lines), then merge into the table::

    python benchmarks/target_plans.py --target v5e-16 --json /tmp/tp/v5e-16.jsonl
    python benchmarks/target_plans.py --table /tmp/tp/*.jsonl \\
        --out benchmarks/results/target_plans.md

Needs libtpu (``pip install 'nnx-spmd-trainer[tpu-plan]'``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import types
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from nnx_spmd_trainer import FSDP, Hybrid, Plan, Target, TensorParallel  # noqa: E402
from nnx_spmd_trainer.app.models import GPT, gpt  # noqa: E402
from nnx_spmd_trainer.planner import target_choice  # noqa: E402
from nnx_spmd_trainer.planner.plan_report import size  # noqa: E402

SEQ = 1024
#: name: (vocab, width, heads, feed-forward, layers)
MODELS = {
    "GPT-2 small": (50304, 768, 12, 3072, 12),
    "GPT-2 medium": (50304, 1024, 16, 4096, 24),
    "GPT-2 large": (50304, 1280, 20, 5120, 36),
    "Qwen3-8B-sized GPT": (151936, 4096, 32, 12288, 36),
}
LAYOUTS = {
    "FSDP": lambda: FSDP(),
    "FSDP x TP4": lambda: Hybrid(FSDP(), TensorParallel(4)),
}
CHUNK = 128


def factory(name: str):
    vocab, width, heads, ff, layers = MODELS[name]

    def build(rngs):
        return GPT(
            vocab_size=vocab, seq_len=SEQ, embed_dim=width, num_heads=heads, ff_dim=ff,
            num_layers=layers, dropout_rate=0.0, rngs=rngs, dtype=jnp.bfloat16,
            scan_layers=True,
        )  # fmt: skip

    return build


def tokens(rows: int) -> dict:
    shape = jax.ShapeDtypeStruct((rows, SEQ), jnp.int32)
    return {"inputs": shape, "targets": shape}


def plan_for(model: str, layout: str, target: str) -> Plan:
    return Plan(
        factory(model), optax.adamw(3e-4), strategy=LAYOUTS[layout](),
        loss_fn=functools.partial(gpt.chunked_loss_fn, chunk_size=CHUNK), target=target,
    )  # fmt: skip


def first_guess(report, chips: int) -> int:
    """Where the search starts doubling: nine tenths of the rows a chip would fit if its
    temporaries grew in proportion to its rows from this one-row-a-chip report (what
    else the peak holds, the state, staying), at least two rows a chip. Close below the
    answer, the search takes three or four compiles, not seven to nine from two rows."""
    memory, hbm = report.memory, report.target["hbm_bytes"]
    fixed, per_row = memory["peak"] - memory["temporaries"], max(memory["temporaries"], 1)
    return max(2, int(0.9 * (hbm - fixed) / per_row)) * chips


def cell(model: str, layout: str, target: str, search: bool) -> dict:
    """One model, layout and target: the report at one row per chip, and the search."""
    chips = Target.parse(target).chips
    start = time.perf_counter()
    plan = plan_for(model, layout, target)
    report = plan.report(tokens(chips))
    row = {
        "model": model, "layout": layout, "target": target, "rows": chips,
        "fits": report.fits, "peak": report.memory["peak"], "hbm": report.target["hbm_bytes"],
        "verdict": report.verdict, "roofline": report.target.get("roofline", {}),
        "links": report.target["links"], "flops": report.flops,
        "parameters": sum(
            r["bytes_per_device"] for r in report.leaves if r["kind"] == "parameters"
        ),
        "seconds": time.perf_counter() - start,
    }  # fmt: skip
    print(f"{target} {model} {layout}: {report.verdict} ({row['seconds']:.0f} s)", flush=True)
    if search and report.fits:
        found = target_choice.largest_batch(
            plan, tokens, start=first_guess(report, chips), step=chips, within=0.25
        )
        first_no = min((n for n, ok, _ in found.compiles if not ok), default=None)
        best = found.rows or chips
        best_report = found.report or report
        row.update(
            largest=best, first_refused=first_no, compiles=len(found.compiles) + 1,
            largest_peak=best_report.memory["peak"],
            largest_roofline=best_report.target.get("roofline", {}),
            search_seconds=time.perf_counter() - start - row["seconds"],
        )  # fmt: skip
        print(f"  {found.lines()[0]}", flush=True)
    return row


def post_training(target: str) -> list[dict]:
    """A DPO step, a GRPO learning step and its rollout (the sampler's program, with its
    cache) of GPT-2 small on ``target``, as ``benchmarks/posttrain_memory.py`` and the
    GRPO dry run plan them; an error is written down as such."""
    import numpy as np

    from nnx_spmd_trainer.post_training import DPOTrainer, GRPOTrainer, PromptRows, ReferenceModel

    rows: list[dict] = []
    model = factory("GPT-2 small")
    chips = Target.parse(target).chips

    def attempt(name: str, plan_it) -> None:
        start = time.perf_counter()
        try:
            report = plan_it()
            row = {"phase": name, "target": target, "fits": report.fits,
                   "peak": report.memory["peak"], "verdict": report.verdict,
                   "roofline": report.target.get("roofline", {})}  # fmt: skip
        except Exception as error:  # written down: what a target cannot plan yet
            row = {"phase": name, "target": target, "error": f"{type(error).__name__}: {error}"}
        row["seconds"] = time.perf_counter() - start
        print(f"{target} {name}: {row.get('verdict', row.get('error', ''))[:300]}", flush=True)
        rows.append(row)

    def ids(n: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((n, SEQ), np.int32)

    def dpo_step():
        dpo = DPOTrainer(
            model, optax.adamw(1e-3), strategy=FSDP(), chunk_size=CHUNK, devices=target
        )
        pairs = {
            f"{side}_{key}": (
                jax.ShapeDtypeStruct((chips, SEQ), np.float32) if key == "weights" else ids(chips)
            )
            for side in ("chosen", "rejected")
            for key in ("inputs", "targets", "weights")
        }
        refs = {k: jax.ShapeDtypeStruct((chips,), np.float32) for k in ReferenceModel.KEYS}
        return dpo.plan.report({**pairs, **refs}, train_step=dpo.train_step)

    def grpo() -> GRPOTrainer:
        prompts = PromptRows.of([{"prompt": [1] * (SEQ // 2 + 1)} for _ in range(chips // 4)])
        return GRPOTrainer(
            model, optax.adamw(1e-3), strategy=FSDP(), prompts=prompts,
            reward_fn=lambda prompts, completions, **_: [0.0] * len(completions),
            group_size=4, max_new_tokens=SEQ // 2, temperature=0.7, top_p=0.9, beta=0.04,
            chunk_size=CHUNK, devices=target,
        )  # fmt: skip

    def grpo_step():
        trainer = grpo()
        return trainer.plan.report(trainer.rollout_spec(chips // 4), train_step=trainer.train_step)

    def grpo_rollout():
        """The rollout's program (prefill and decode as one) as the GRPO dry run plans it."""
        from nnx_spmd_trainer.app.post_training_phases import phases

        trainer = grpo()
        planned = phases(trainer, 0, trainer.rollout_spec(chips // 4))
        rollout = next(phase for phase in planned if phase.name.startswith("rollout"))
        hbm = Target.parse(target).chip.hbm_bytes
        fits = rollout.peak_bytes <= hbm
        verdict = (
            f"{'fits' if fits else 'does not fit'}: {rollout.name} peak "
            f"{gib(rollout.peak_bytes)}{rollout.note} of {gib(hbm)} per chip"
        )
        return types.SimpleNamespace(
            fits=fits, memory={"peak": rollout.peak_bytes}, verdict=verdict, target={}
        )

    attempt(f"DPO step, {chips} pairs", dpo_step)
    attempt(f"GRPO learning step, {chips // 4} prompts x 4", grpo_step)
    attempt(f"GRPO rollout, {chips // 4} prompts x 4", grpo_rollout)
    return rows


def gib(n: float) -> str:
    return size(n)


def markdown(rows: list[dict]) -> str:
    # One line a cell: its runs merged in the order given, a later run's figures over an
    # earlier's (a verdict-only rerun keeps the search's largest batch).
    by_cell: dict[tuple[str, str, str], dict] = {}
    for r in (r for r in rows if "model" in r):
        by_cell.setdefault((r["model"], r["target"], r["layout"]), {}).update(r)
    order = {name: i for i, name in enumerate(MODELS)}
    cells = sorted(
        by_cell.values(),
        key=lambda r: (r["target"], list(LAYOUTS).index(r["layout"]), order[r["model"]]),
    )
    phases = [r for r in rows if "phase" in r]
    out = [
        "# Plans for TPU pods that are not here",
        "",
        "Written by `benchmarks/target_plans.py` (see its docstring for the models and the "
        "command). Every figure is the TPU compiler's (libtpu 0.0.42.1, compiling on a CPU "
        "for chips described by `jax.experimental.topologies`) or the roofline from the chip "
        "table (`nnx_spmd_trainer/planner/target_chips.py`, Google's per-chip figures). "
        f"{SEQ} positions; one row per chip unless said.",
        "",
        "| model | target | layout | fits (1 row/chip) | peak per chip | of HBM | "
        "step time >= | bound by | MFU <= | largest batch that fits | peak there | compiles |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in cells:
        times = r.get("roofline") or {}
        bound = times.get("bound_s")
        by = (
            max(("compute", "hbm", "ici", "dcn"), key=lambda k: times.get(f"{k}_s", 0.0))
            if times
            else "-"
        )
        mfu = f"{100 * times['mfu']:.0f}%" if times else "-"
        largest = "-"
        if "largest" in r:
            cap = f" (< {r['first_refused']})" if r.get("first_refused") else " (search limit)"
            largest = f"{r['largest']} rows{cap}"
        out.append(
            f"| {r['model']} | {r['target']} | {r['layout']} | "
            f"{'yes' if r['fits'] else 'no'} | {gib(r['peak'])} | {gib(r['hbm'])} | "
            f"{f'{bound * 1e3:.1f} ms' if bound else '-'} | {by} | "
            f"{mfu} | {largest} | "
            f"{gib(r['largest_peak']) if 'largest_peak' in r else '-'} | "
            f"{r.get('compiles', 1)} |"
        )
    if phases:
        out += ["", "## Post-training phases", "", "| phase | target | verdict |", "|---|---|---|"]
        for r in phases:
            text = r.get("verdict") or f"not plannable yet: {r.get('error', '')[:300]}"
            out.append(f"| {r['phase']} | {r['target']} | {text.replace('|', '/')} |")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="one target (v5e-16, v5p-64, v6e-256)")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--no_search", action="store_true", help="skip the largest batch")
    parser.add_argument(
        "--search_only", action="store_true", help="no verdict pass first (known already)"
    )
    parser.add_argument("--post_training", action="store_true", help="DPO and GRPO steps")
    parser.add_argument("--json", type=Path, help="append one JSON line per cell here")
    parser.add_argument("--table", nargs="*", type=Path, help="JSON-lines files to merge")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/target_plans.md"))
    args = parser.parse_args()
    if args.table:
        rows = [json.loads(line) for f in args.table for line in f.read_text().splitlines()]
        args.out.write_text(markdown(rows))
        print(f"wrote {args.out}")
        return
    if args.target is None:
        sys.exit("give --target (or --table to merge)")
    models, layouts = args.models.split(","), args.layouts.split(",")
    jobs = [(m, lay) for lay in layouts for m in models]
    rows: list[dict] = []

    def keep(row: dict) -> None:
        rows.append(row)
        if args.json:
            with args.json.open("a") as f:
                f.write(json.dumps(row) + "\n")

    if args.post_training:
        for row in post_training(args.target):
            keep(row)
        return
    for model, layout in jobs:  # the verdict of every cell first, then the searches
        if not args.search_only:
            keep(cell(model, layout, args.target, search=False))
    if not args.no_search:
        for model, layout in jobs:
            done = next((r for r in rows if r["model"] == model and r["layout"] == layout), {})
            if done.get("fits", True):  # (a cell that does not fit is left at its verdict)
                searched = cell(model, layout, args.target, search=True)
                keep({**searched, "searched": True})


if __name__ == "__main__":
    main()
