"""``nnx-spmd-train generate``: text from a workdir's checkpoint, or from a safetensors file,
on the mesh the run trained on; nothing trained and nothing written.

    nnx-spmd-train generate runs/default --prompt "Once upon" --max_new_tokens 40
    nnx-spmd-train generate runs/default --step best --prompts_file prompts.txt --json
    nnx-spmd-train generate runs/gpt2 --weights exported/model.safetensors \
        --tokenizer tokenizer.json --prompt "Hello" --temperature 0.8 --top_p 0.9

The workdir says what to build (``WORKDIR/config.json``: the model, its sizes, the
layout) and which tokenizer the run saved; the weights are its checkpoint (``--step``:
``latest``, ``best`` or a step number) or, with ``--weights``, a safetensors file read
through the task's weight map (``config.init_from``'s path: Hugging Face's GPT-2 files,
or a run's ``--export_format=safetensors``). Sampling is ``Sampler.generate``'s:
greedy at ``--temperature 0``, seeded per (seed, step, row). It prints each
continuation (``--json``: one JSON line per prompt with its tokens and their
log-probabilities), then one line of prefill and decode tokens/s. Each refusal is one
line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ml_collections

# callbacks/ is mapped onto nnx_spmd_trainer.callbacks at install time; mypy reads the tree.
from nnx_spmd_trainer import Sampler, Sampling, Trainer, callbacks  # type: ignore[attr-defined]
from nnx_spmd_trainer.app import datasets, tasks
from nnx_spmd_trainer.app.command_line import fail
from nnx_spmd_trainer.app.console import say
from nnx_spmd_trainer.app.evaluate import run_config
from nnx_spmd_trainer.app.host_devices import simulate_host_devices
from nnx_spmd_trainer.app.job import _build_trainer, _choose_layout, _layout_asked, pretrained
from nnx_spmd_trainer.app.job_checks import blamed_on
from nnx_spmd_trainer.data.tokenizer import TokenizerError, load_tokenizer
from nnx_spmd_trainer.sharding import ShardingError

__all__ = ["main", "parser"]

DEFAULT_NEW_TOKENS = 32


def _step(value: str) -> str | int:
    if value in ("latest", "best"):
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--step={value!r}: give latest, best or a step number"
        ) from None


def parser() -> argparse.ArgumentParser:
    """The command's arguments."""
    commands = argparse.ArgumentParser(
        prog="nnx-spmd-train generate",
        description="Continue prompts with a workdir's model (trains nothing, writes nothing).",
    )
    add = commands.add_argument
    add("workdir", help="the --workdir of a run (its config.json; its checkpoints/)")
    add("--step", type=_step, default="latest", help="latest (default), best or a step number")
    add("--weights", default=None, help="a safetensors file to sample from instead")
    add("--tokenizer", default=None, help="a tokenizer.json instead of the run's own")
    add("--prompt", action="append", default=[], help="a prompt (repeat for several)")
    add("--prompts_file", default=None, help="a file of prompts, one per line")
    add("--max_new_tokens", type=int, default=None, help="default: 32, or what the context leaves")
    add("--temperature", type=float, default=0.0, help="0: greedy")
    add("--top_k", type=int, default=0, help="0: no top-k truncation")
    add("--top_p", type=float, default=1.0, help="in (0, 1]; 1: no nucleus truncation")
    add("--seed", type=int, default=0)
    add("--stop", action="append", default=[], help="a stop string (repeat for several)")
    add("--end_token", type=int, default=None, help="the id that ends a row (default: the EOS)")
    add("--json", action="store_true", help="one JSON line per prompt: text, tokens, log_probs")
    return commands


class _Refused(Exception):
    """A bad input found after the arguments parsed: its one line."""


def _prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts_file is not None:
        try:
            text = Path(args.prompts_file).read_text(encoding="utf-8")
        except OSError as error:
            raise _Refused(f"--prompts_file={args.prompts_file}: {error.strerror}") from None
        prompts += [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise _Refused("no prompt: give --prompt TEXT (repeatable) or --prompts_file FILE.")
    return prompts


def _vocabulary(model: Any) -> int | None:
    """The token ids a shipped model embeds (GPT's ``vocab_size``, GPT-2's config)."""
    for owner in (model, getattr(model, "config", None)):
        value = getattr(owner, "vocab_size", None)
        if isinstance(value, int):
            return value
    return None


def _tokenizer(args: argparse.Namespace, run_tokenizer: Any, model: Any) -> Any:
    """``--tokenizer`` checked against the model's vocabulary, else the run's own."""
    if args.tokenizer is None:
        if run_tokenizer is None:
            raise _Refused(
                f"{args.workdir}: the run saved no tokenizer; give --tokenizer tokenizer.json."
            )
        return run_tokenizer
    try:
        tokenizer = load_tokenizer(args.tokenizer)
    except (OSError, TokenizerError, ValueError) as error:
        raise _Refused(f"--tokenizer={args.tokenizer}: {error}") from None
    vocabulary = _vocabulary(model)
    if vocabulary is not None and tokenizer.vocab_size > vocabulary:
        raise _Refused(
            f"--tokenizer={args.tokenizer} has {tokenizer.vocab_size} tokens and the model "
            f"embeds {vocabulary}: it is not this model's tokenizer; give the one it trained with."
        )
    return tokenizer


def _trainer(args: argparse.Namespace, config: ml_collections.ConfigDict) -> tuple[Trainer, Any]:
    """The run's model, its weights from the checkpoint (or ``--weights``), and the run's
    tokenizer (``None`` where it saved none)."""
    workdir = Path(args.workdir)
    layout = _layout_asked(config)
    if args.weights is not None:
        config.init_from = args.weights
    with blamed_on(f"config.{config.model}"):
        task_config = datasets.from_config.run_tokenizer_config(config, workdir)
        task = tasks.build_task(task_config, shard=layout.shard)
    init_from = pretrained(config, task) if args.weights is not None else None
    trainer: Trainer = _build_trainer(config, task, layout, [], init_from)
    _choose_layout(trainer, layout.strategy, task.splits)
    if args.weights is None:
        checkpoint = callbacks.OrbaxCheckpoint(
            workdir / "checkpoints", restore=args.step, print_fn=None
        )
        try:
            restored = checkpoint.restore_into(trainer)
        except (FileNotFoundError, ValueError, callbacks.DamagedCheckpoint) as error:
            raise _Refused(f"--step={args.step}: {error}") from None
        if restored is None:
            raise _Refused(f"{workdir / 'checkpoints'} holds no checkpoint to generate from.")
        say(f"generating from step {restored} of {workdir}")
    else:
        say(f"generating from {args.weights} (the model of {workdir})")
    return trainer, task.splits.text_codec


def generate(args: argparse.Namespace, config: ml_collections.ConfigDict) -> list[dict[str, Any]]:
    """Each prompt's continuation as printed (``text``, ``tokens``, ``log_probs``)."""
    how = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    prompts = _prompts(args)
    trainer, run_tokenizer = _trainer(args, config)
    model = trainer.model
    tokenizer = _tokenizer(args, run_tokenizer, model)
    sampler = Sampler(model, trainer.plan, tokenizer=tokenizer, print_fn=say)
    end = args.end_token if args.end_token is not None else getattr(tokenizer, "eos_id", None)
    max_new = args.max_new_tokens
    if max_new is None:  # 32, or what the longest prompt leaves of the context
        longest = max(len(tokenizer.encode(p)) for p in prompts)
        room = (sampler.context_length or 0) - longest
        fits = sampler.context_length is not None and room > 0
        max_new = min(DEFAULT_NEW_TOKENS, room) if fits else DEFAULT_NEW_TOKENS
    try:
        out = sampler.generate(
            prompts, max_new_tokens=max_new, temperature=how.temperature,
            top_k=how.top_k, top_p=how.top_p, seed=args.seed, end_token=end, stop=args.stop,
        )  # fmt: skip
    except ValueError as error:  # a prompt longer than the context, a cache too large
        raise _Refused(str(error)) from None
    texts = out.text or [" ".join(map(str, t)) for t in out.tokens]
    rows = [
        {"prompt": p, "text": t, "tokens": tokens, "log_probs": log_probs, "finish": finish}
        for p, t, tokens, log_probs, finish in zip(
            prompts, texts, out.tokens, out.log_probs, out.finish, strict=True
        )
    ]
    for row, prompt, text in zip(rows, prompts, texts, strict=True):
        print(json.dumps(row) if args.json else prompt + text, flush=True)
    generated = sum(len(t) for t in out.tokens)
    say(
        f"generated {generated} tokens for {len(prompts)} prompts: prefill "
        f"{out.prefill_tokens_per_second:,.0f} tokens/s, decode "
        f"{out.decode_tokens_per_second:,.0f} tokens/s"
    )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Prints the continuations; returns 0, or exits 2 with one line."""
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    workdir = Path(args.workdir)
    if args.weights is None and not any(
        p.name.isdigit() for p in (workdir / "checkpoints").glob("*")
    ):
        fail(
            f"generate: no checkpoint in {workdir / 'checkpoints'}: train first (nnx-spmd-train "
            f"--workdir={workdir}), or give --weights FILE.safetensors."
        )
    if args.weights is not None and not Path(args.weights).is_file():
        fail(f"generate: --weights={args.weights}: there is no file there.")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        fail(f"generate: --max_new_tokens={args.max_new_tokens}; it must be >= 1.")
    config = run_config(workdir, None)
    simulate_host_devices(config.get("num_devices", 8))  # before JAX starts its backend
    try:
        Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
        generate(args, config)
    except (_Refused, tasks.ConfigError, ShardingError, ValueError, TypeError) as error:
        message = str(error)
        fail(message if message.startswith("generate:") else f"generate: {message}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
