"""Memory per device of post-training at a large vocabulary: SFT, DPO, GRPO, the reference
pass and lm-eval's scoring, each the compiled program's own ``memory_analysis()``.

The shipped GPT with a Qwen3-sized vocabulary (151,936 ids), 1024 positions, 1 layer of
64 wide, 16 rows, ``FSDP(8)`` on 8 simulated CPU devices, fp32, AdamW; and GPT-2 (its
tied head) at its own vocabulary (50,257). The train steps through ``Plan.report``
(peak = arguments + outputs - donated + temporaries + code); the forward-only programs
through ``Plan.forward_program`` (the same sum). No array of a step is built and no
step runs.

- SFT chunked: ``gpt.chunked_loss_fn`` (chunks of 128 positions); SFT full logits:
  ``gpt.loss_fn``.
- DPO: 8 pairs (16 rows), ``DPOTrainer``'s step (chosen and rejected in one pass).
- GRPO: ``GRPOTrainer``'s learning step on a rollout of 4 prompts x 4 completions
  (16 rows; temperature 0.7, top-p 0.9, a reference: ``beta=0.04``).
- chunked forward: the chunked per-token log-probabilities of 16 rows, forward only
  (``nn.logprob_model.model_token_scores``); the reference pass (DPO's, 8 pairs) and
  lm-eval's scoring (``HarnessLM``'s ``score_tokens``, 16 rows) are compared with it.
- the threshold: SFT's step, plain and chunked, from 512 to 32,768 ids at 1024
  positions: where the default (``config.gpt.chunked_loss=-1``) starts chunking.

    python benchmarks/posttrain_memory.py [--out benchmarks/results/posttrain_memory.md]
"""

import argparse
import functools
import os
import time

_flags = os.environ.get("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
if "xla_backend_optimization_level" not in _flags:  # faster compiles, the same bytes
    _flags += " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ["XLA_FLAGS"] = _flags
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from nnx_spmd_trainer import FSDP, Trainer  # noqa: E402
from nnx_spmd_trainer.app.models import GPT, gpt  # noqa: E402
from nnx_spmd_trainer.app.models.gpt2_hf import GPT2, GPT2Config  # noqa: E402
from nnx_spmd_trainer.generate.harness import score_tokens  # noqa: E402
from nnx_spmd_trainer.nn.logprob_model import model_token_scores  # noqa: E402
from nnx_spmd_trainer.planner.forward import abstract  # noqa: E402
from nnx_spmd_trainer.post_training import DPOTrainer, GRPOTrainer, PromptRows  # noqa: E402

MiB = 2**20
ROWS, SEQ, WIDTH, CHUNK = 16, 1024, 64, 128


def gpt_model(vocab: int):
    def build(rngs: nnx.Rngs) -> nnx.Module:
        return GPT(vocab, SEQ, WIDTH, 4, 4 * WIDTH, 1, 0.0, rngs)

    return build


def gpt2_model(vocab: int):
    config = GPT2Config(
        vocab_size=vocab, n_positions=SEQ, n_embd=WIDTH, n_layer=1, n_head=4, dropout=0.0,
        pad_vocab_to=64,
    )  # fmt: skip

    def build(rngs: nnx.Rngs) -> nnx.Module:
        return GPT2(config, rngs=rngs)

    return build


def peak(compiled) -> int:
    """``Plan.report``'s peak: arguments + outputs - aliased + temporaries + code."""
    a = compiled.memory_analysis()
    return int(
        a.argument_size_in_bytes
        + a.output_size_in_bytes
        - a.alias_size_in_bytes
        + a.temp_size_in_bytes
        + a.generated_code_size_in_bytes
    )


def ids(rows: int = ROWS) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((rows, SEQ), np.int32)


def table(rows: int = ROWS) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((rows, SEQ), np.float32)


def step_peak(trainer: Trainer, shapes: dict) -> int:
    report = trainer.plan.report(shapes, train_step=trainer.train_step)
    return int(report.memory["peak"])


def forward_peak(trainer: Trainer, fn, shapes: dict, state=None, graphdef=None) -> int:
    """The peak of ``fn(model, batch)`` compiled by ``Plan.forward_program`` on ``shapes``."""
    state = nnx.state(trainer.model) if state is None else state
    graphdef = nnx.graphdef(trainer.model) if graphdef is None else graphdef
    plan = trainer.plan
    placed = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        shapes,
        plan.batch_shardings(shapes),
    )
    program = plan.forward_program(fn, graphdef, state, placed)
    with jax.set_mesh(plan.mesh):
        return peak(program.lower(abstract(state), placed).compile())


def chunked_forward(model: nnx.Module, batch: dict) -> jax.Array:
    return model_token_scores(model, batch["inputs"], batch["targets"], chunk_size=CHUNK)[0]


def measure(name: str, build, vocab: int) -> list[tuple[str, int]]:
    """Each program's peak per device for one model."""
    model = build(vocab)
    strategy = FSDP(8)
    rows: list[tuple[str, int]] = []

    def timed(label: str, fn) -> int:
        start = time.perf_counter()
        value = fn()
        print(f"  {name} {label}: {value / MiB:.0f} MiB ({time.perf_counter() - start:.0f} s)")
        rows.append((label, value))
        return value

    sft = {"inputs": ids(), "targets": ids()}
    chunked = Trainer(
        model,
        optax.adamw(1e-3),
        strategy=strategy,
        loss_fn=functools.partial(gpt.chunked_loss_fn, chunk_size=CHUNK),
    )
    timed("SFT, chunked loss (chunk 128)", lambda: step_peak(chunked, sft))
    plain = Trainer(model, optax.adamw(1e-3), strategy=strategy, loss_fn=gpt.loss_fn)
    timed("SFT, full logits", lambda: step_peak(plain, sft))

    pairs = {
        f"{side}_{key}": (table(8) if key == "weights" else ids(8))
        for side in ("chosen", "rejected")
        for key in ("inputs", "targets", "weights")
    }
    dpo = DPOTrainer(model, optax.adamw(1e-3), strategy=strategy, chunk_size=CHUNK)
    ref_keys = {k: jax.ShapeDtypeStruct((8,), np.float32) for k in dpo.reference.KEYS}
    timed("DPO step, 8 pairs", lambda: step_peak(dpo, {**pairs, **ref_keys}))

    prompts = PromptRows.of([{"prompt": [1] * (SEQ // 2 + 1)} for _ in range(4)])
    grpo = GRPOTrainer(
        model, optax.adamw(1e-3), strategy=strategy, prompts=prompts,
        reward_fn=lambda prompts, completions, **_: [0.0] * len(completions),
        group_size=4, max_new_tokens=SEQ // 2, temperature=0.7, top_p=0.9, beta=0.04,
        chunk_size=CHUNK,
    )  # fmt: skip
    timed("GRPO learning step, 16 rows", lambda: step_peak(grpo, grpo.rollout_spec(4)))

    timed("chunked forward, 16 rows", lambda: forward_peak(chunked, chunked_forward, sft))
    reference = dpo.reference
    timed(
        "DPO reference pass, 8 pairs",
        lambda: forward_peak(
            dpo, dpo._reference_pass, pairs, state=reference.state, graphdef=reference.graphdef
        ),
    )
    timed("lm-eval scoring, 16 rows", lambda: forward_peak(chunked, score_tokens(), sft))
    return rows


#: The vocabularies of the chunked loss's threshold table (1024 positions each).
THRESHOLD_VOCABS = (512, 2048, 4096, 8192, 32768)


def threshold_table() -> str:
    """SFT's step peak, plain and chunked, by vocabulary x positions: where the chunked
    loss starts to pay (``app.tasks.CHUNKED_FROM``, the default's threshold)."""
    lines = [
        "### SFT: plain and chunked loss by vocabulary x positions (GPT, 1024 positions)",
        "",
        "| vocabulary x positions | plain | chunked (128) | chunked / plain |",
        "|---|---|---|---|",
    ]
    sft = {"inputs": ids(), "targets": ids()}
    for vocab in THRESHOLD_VOCABS:
        model = gpt_model(vocab)
        peaks = []
        for loss in (gpt.loss_fn, functools.partial(gpt.chunked_loss_fn, chunk_size=CHUNK)):
            trainer = Trainer(model, optax.adamw(1e-3), strategy=FSDP(8), loss_fn=loss)
            peaks.append(step_peak(trainer, sft))
        plain, chunked = peaks
        print(f"  threshold: {vocab} x {SEQ}: plain {plain / MiB:.0f}, chunked {chunked / MiB:.0f}")
        lines.append(
            f"| {vocab:,} x {SEQ} = {vocab * SEQ:,} | {plain / MiB:,.0f} MiB | "
            f"{chunked / MiB:,.0f} MiB | {chunked / plain:.2f} |"
        )
    return "\n".join(lines)


def markdown(name: str, vocab: int, rows: list[tuple[str, int]]) -> str:
    by = dict(rows)
    sft = by["SFT, chunked loss (chunk 128)"]
    forward = by["chunked forward, 16 rows"]
    lines = [
        f"### {name}, vocabulary {vocab:,}",
        "",
        "| program | peak / device | ratio |",
        "|---|---|---|",
    ]
    for label, value in rows:
        if label.startswith(("DPO step", "GRPO", "SFT, full")):
            ratio = f"{value / sft:.2f}x SFT chunked"
        elif label.startswith(("DPO reference", "lm-eval")):
            ratio = f"{value / forward:.2f}x chunked forward"
        else:
            ratio = ""
        lines.append(f"| {label} | {value / MiB:,.0f} MiB | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/posttrain_memory.md")
    parser.add_argument("--only", choices=("gpt", "gpt2", "threshold"), default=None)
    args = parser.parse_args()
    jnp.zeros(())  # the backend up before the clock
    models = [("GPT", gpt_model, 151_936), ("GPT-2", gpt2_model, 50_257)]
    parts = []
    for name, build, vocab in models:
        if args.only and args.only != ("gpt" if name == "GPT" else "gpt2"):
            continue
        parts.append(markdown(name, vocab, measure(name, build, vocab)))
    if args.only in (None, "threshold"):
        parts.append(threshold_table())
    head = (
        "## Post-training memory per device\n\n"
        f"`python benchmarks/posttrain_memory.py`: {SEQ} positions, 1 layer of {WIDTH}, "
        f"{ROWS} rows (DPO: 8 pairs), FSDP(8) on 8 simulated CPU devices, fp32, AdamW; "
        "each program's compiled `memory_analysis()` (arguments + outputs - donated + "
        "temporaries + code), as `Plan.report` counts it. Chunks of 128 positions.\n"
    )
    text = head + "\n" + "\n\n".join(parts) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
