"""``nnx-spmd-train generate``: text from a workdir's checkpoint, or from a safetensors file,
on the mesh the run trained on; nothing trained and nothing written.

    nnx-spmd-train generate runs/default --prompt "Once upon" --max_new_tokens 40
    nnx-spmd-train generate runs/default --step best --prompts_file prompts.jsonl --json
    nnx-spmd-train generate runs/gpt2 --weights gpt2/model.safetensors \
        --tokenizer gpt2/tokenizer.json --prompt "Hello" --temperature 0.8 --top_p 0.9

The workdir says what to build (``WORKDIR/config.json``: the model, its sizes, the
layout) and which tokenizer the run used; the weights are its checkpoint (``--step``:
``latest``, ``best`` (the saved step with the lowest ``eval/loss`` in the run's
``metrics.csv``) or a step number) or, with ``--weights``, a safetensors file (or a
folder of them) read through the task's weight map (``config.init_from``'s path:
Hugging Face's GPT-2 files, or a run's ``--export_format=safetensors``); without a
workdir, ``--weights DIR`` is a Hugging Face GPT-2 folder, its ``config.json`` sizing the
shipped ``gpt2_hf`` model and its ``tokenizer.json`` the text. Sampling is
``Sampler.generate``'s: greedy at ``--temperature 0``, seeded per (seed, step, row).
On a chat run (its tokenizer has a chat template: ``--config.data.chat``) each prompt is
a user message rendered with the template and its generation prompt, and a row ends at
the template's end of turn (``<|im_end|>``); ``--raw`` gives the text as it is, and a
JSONL row's ``"messages"`` list is rendered as the conversation it is.
It prints each prompt, `` >>> `` and its continuation (``--logprobs``: and its tokens'
log-probabilities; ``--json``: one JSON line per prompt on stdout, everything else on
stderr), then one line of prefill and decode tokens/s (``Generation``'s). A line says
when it compiles. Each refusal is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ml_collections

# callbacks/ is mapped onto nnx_spmd_trainer.callbacks at install time; mypy reads the tree.
from nnx_spmd_trainer import Generation, Sampler, Sampling, ShardingError, Trainer, callbacks  # type: ignore[attr-defined]
from nnx_spmd_trainer.app import loader, tasks
from nnx_spmd_trainer.app.command_line import OneLineParser, checkpoint_step, fail
from nnx_spmd_trainer.app.console import say
from nnx_spmd_trainer.app.evaluate import run_config
from nnx_spmd_trainer.app.host_devices import simulate_host_devices
from nnx_spmd_trainer.configs import gpt2_hf
from nnx_spmd_trainer.data import TokenizerError, load_tokenizer

__all__ = ["generate", "main", "parser"]

#: New tokens when ``--max_new_tokens`` is not given (fewer where the context ends first).
DEFAULT_NEW_TOKENS = 32


class _Refused(Exception):
    """A bad input found after the arguments parsed: its one line."""


def _finite(value: str) -> float:
    """A float argument; ``nan`` and ``inf`` would pass ``Sampling``'s range checks."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"{value!r} is not a finite number")
    return number


def parser() -> argparse.ArgumentParser:
    """The command's arguments."""
    commands = OneLineParser(
        prog="nnx-spmd-train generate",
        description="Continue prompts with a workdir's model (trains nothing, writes nothing).",
    )
    add = commands.add_argument
    add("workdir", nargs="?", default=None,
        help="the --workdir of a run (its config.json; its checkpoints/); without one, "
        "--weights names a Hugging Face GPT-2 folder (its config.json)")  # fmt: skip
    add("--step", type=checkpoint_step, default="latest",
        help="latest (default), best or a step number")  # fmt: skip
    add("--weights", default=None, help="a safetensors file (or folder) to sample from instead")
    add("--tokenizer", default=None, help="a tokenizer.json instead of the run's own")
    add("--prompt", action="append", default=[], help="a prompt (repeat for several)")
    add("--prompts_file", default=None, help="prompts: one a line, or JSONL (.jsonl)")
    add("--max_new_tokens", type=int, default=None,
        help=f"default {DEFAULT_NEW_TOKENS}, or what the model's context leaves")  # fmt: skip
    add("--temperature", type=_finite, default=0.0, help="0: greedy")
    add("--top_k", type=int, default=0, help="0: no top-k truncation")
    add("--top_p", type=_finite, default=1.0, help="in (0, 1]; 1: no nucleus truncation")
    add("--seed", type=int, default=0)
    add("--stop", action="append", default=[], help="a stop string (repeat for several)")
    add("--end_token", type=int, default=None, help="the id that ends a row (default: the EOS)")
    add("--logprobs", action="store_true", help="print each token's log-probability too")
    add("--json", action="store_true", help="one JSON line per prompt: text, tokens, log_probs")
    add("--raw", action="store_true",
        help="on a chat run, the prompt as it is, not rendered as a user message")  # fmt: skip
    return commands


#: What is printed between a prompt and its continuation.
SEPARATOR = " >>> "

#: A prompt: text, or (a JSONL row's ``"messages"``) a conversation for a chat template.
Prompt = str | list[dict[str, Any]]


def _jsonl_prompt(line: str, where: str) -> Prompt:
    try:
        value = json.loads(line)
    except ValueError as error:
        raise _Refused(f"{where} is not JSON ({error}); give one object a line.") from None
    if isinstance(value, dict) and "messages" in value:
        messages = value["messages"]
        if isinstance(messages, list) and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and
            isinstance(m.get("content"), str) for m in messages
        ) and messages:  # fmt: skip
            return messages
        raise _Refused(f'{where}: "messages" must be a list of {{"role", "content"}} strings.')
    if isinstance(value, dict):
        value = value.get("prompt")
    if not isinstance(value, str):
        raise _Refused(
            f'{where}: give {{"prompt": "..."}}, {{"messages": [...]}} (a chat run) or a JSON '
            "string on each line."
        )
    return value


def prompts_of(args: argparse.Namespace) -> list[Prompt]:
    """``--prompt``s, then ``--prompts_file``'s: one a line, or for a ``.jsonl`` file one
    JSON object a line with its ``"prompt"`` (or a JSON string), so a prompt may hold
    newlines, or its ``"messages"`` (a conversation, for a chat run). Blank lines are
    skipped."""
    prompts: list[Prompt] = list(args.prompt)
    if args.prompts_file is not None:
        file = Path(args.prompts_file)
        try:
            lines = file.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeError) as error:
            raise _Refused(f"--prompts_file={file}: {error}") from None
        numbered = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
        if file.suffix == ".jsonl":
            prompts += [
                _jsonl_prompt(line, f"--prompts_file={file} line {n}") for n, line in numbered
            ]
        else:
            prompts += [line for _, line in numbered]
    if not prompts:
        raise _Refused("no prompt: give --prompt TEXT (repeatable) or --prompts_file FILE.")
    return prompts


#: Hugging Face's GPT-2 ``config.json`` keys, and the ``config.gpt2_hf`` key each sets.
_HF_GPT2_KEYS = {"vocab_size": "vocab_size", "n_positions": "n_positions", "n_embd": "n_embd",
                 "n_layer": "n_layer", "n_head": "n_head"}  # fmt: skip


def hf_gpt2_config(weights: Path) -> ml_collections.ConfigDict:
    """The shipped ``gpt2_hf`` config sized by the Hugging Face GPT-2 ``config.json`` in
    the ``weights`` folder (or beside the ``weights`` file): what to build when no
    workdir says it."""
    folder = weights if weights.is_dir() else weights.parent
    record = folder / "config.json"
    try:
        hf = json.loads(record.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise _Refused(
            f"--weights={weights} without a WORKDIR needs Hugging Face's config.json beside "
            f"it ({record}: {error}); or give the WORKDIR of the run the weights are from."
        ) from None
    if hf.get("model_type") != "gpt2" or not all(k in hf for k in _HF_GPT2_KEYS):
        raise _Refused(
            f"{record} is not a GPT-2 config (model_type={hf.get('model_type')!r}; needs "
            f"{sorted(_HF_GPT2_KEYS)}); without a WORKDIR only GPT-2 folders are read."
        )
    config = gpt2_hf.get_config()
    config.gpt2_hf.update({ours: int(hf[theirs]) for theirs, ours in _HF_GPT2_KEYS.items()})
    config.gpt2_hf.update(seq_len=config.gpt2_hf.n_positions, dropout=0.0)
    return config


def _vocabulary(model: Any) -> int | None:
    """The token ids a shipped model embeds (GPT's ``vocab_size``, GPT-2's config)."""
    for owner in (model, getattr(model, "config", None)):
        value = getattr(owner, "vocab_size", None)
        if isinstance(value, int):
            return value
    return None


def _tokenizer(args: argparse.Namespace, run_tokenizer: Any, model: Any, model_name: str) -> Any:
    """``--tokenizer`` checked against the model's vocabulary, else the run's own."""
    if args.tokenizer is None:
        if run_tokenizer is None:
            raise _Refused(
                f"{args.workdir}: its task (config.model={model_name!r}) is not text and has no "
                "tokenizer; generate continues a language model's prompts (gpt, gpt2_hf), or "
                "give --tokenizer tokenizer.json."
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


def _trainer(
    args: argparse.Namespace, config: ml_collections.ConfigDict
) -> tuple[Trainer, Any, str]:
    """The run's model with its weights from the checkpoint (or ``--weights``), the run's
    text codec (``None`` where its task is not text) and where the weights came from
    (``loader.load_run``: any run's workdir, DPO's and GRPO's too)."""
    note = (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else say
    try:
        run = loader.load_run(
            args.workdir, step=args.step, weights_file=args.weights, config=config, print_fn=note
        )
    except (callbacks.CheckpointOfAnotherModel, callbacks.DamagedCheckpoint) as error:
        raise _Refused(f"--step={args.step}: {error}") from None
    return run.trainer, run.tokenizer, run.source


def _is_chat(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` renders conversations (``data.ChatTokenizer``: a chat run's)."""
    return callable(getattr(tokenizer, "prompt_ids", None))


def _prompt_ids(prompts: Sequence[Prompt], tokenizer: Any, *, raw: bool) -> list[list[int]]:
    """Each prompt's ids: on a chat run a user message (or the row's messages) rendered
    with the template's generation prompt, or with ``raw`` the text as it is; else the
    text through the tokenizer."""
    chat = _is_chat(tokenizer)
    if not chat and any(not isinstance(p, str) for p in prompts):
        raise _Refused(
            'a "messages" prompt needs a chat run\'s tokenizer (one with a chat template); '
            'this run\'s has none: give {"prompt": "..."} rows.'
        )
    if raw and any(not isinstance(p, str) for p in prompts):
        raise _Refused('--raw gives text as it is: a "messages" row has no raw text.')
    try:
        if chat and not raw:
            return [[int(t) for t in tokenizer.prompt_ids(p)] for p in prompts]
        encode = tokenizer.encode_text if chat else tokenizer.encode
        return [[int(t) for t in encode(p)] for p in prompts]
    except (ValueError, KeyError) as error:  # a character the run's text never had
        raise _Refused(f"a prompt does not encode with the run's tokenizer: {error}") from None
    except Exception as error:  # the chat template's own raise_exception, a Jinja error
        if not chat:
            raise
        raise _Refused(f"the run's chat template fails on a prompt ({error}).") from None


def _end_token(tokenizer: Any) -> int | None:
    """The id a row ends at: a chat template's end of turn, else the end of a document."""
    if _is_chat(tokenizer) and tokenizer.end_of_turn_id is not None:
        return int(tokenizer.end_of_turn_id)
    eos = getattr(tokenizer, "eos_id", None)
    return None if eos is None else int(eos)


def _saved_steps(workdir: Path) -> list[int]:
    return loader.saved_steps(workdir)


def _new_tokens(args: argparse.Namespace, ids: list[list[int]], context: int | None) -> int:
    """``--max_new_tokens``, or the default cut to what the context leaves the longest
    prompt; a prompt that fills the context is refused."""
    longest = max(len(p) for p in ids)
    if context is not None and longest >= context:
        raise _Refused(
            f"a prompt of {longest} tokens fills the model's context of {context} positions; "
            "shorten it."
        )
    if args.max_new_tokens is not None:
        return int(args.max_new_tokens)
    return DEFAULT_NEW_TOKENS if context is None else min(DEFAULT_NEW_TOKENS, context - longest)


def _lines(row: dict[str, Any], args: argparse.Namespace, tokenizer: Any) -> list[str]:
    """What is printed of one continuation."""
    if args.json:
        return [json.dumps(row)]
    prompt = row["prompt"]
    shown = prompt if isinstance(prompt, str) else prompt[-1]["content"]
    lines = [shown + SEPARATOR + row["text"]]
    if args.logprobs:
        pieces = [f"{tokenizer.decode([t])!r}={lp:.4f}" for t, lp in zip(
            row["tokens"], row["log_probs"], strict=True)]  # fmt: skip
        total = sum(row["log_probs"])
        lines.append(f"  log-probs ({row['finish']}, total {total:.4f}): " + " ".join(pieces))
    return lines


def generate(args: argparse.Namespace, config: ml_collections.ConfigDict) -> list[dict[str, Any]]:
    """Each prompt's continuation as printed (``prompt``, ``text``, ``tokens``,
    ``log_probs``, ``finish``, ``source``): the model of ``config`` (a workdir's) with
    the weights ``args`` name, sampled as ``args`` say."""
    note = (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else say
    how = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    prompts = prompts_of(args)
    trainer, run_tokenizer, source = _trainer(args, config)
    tokenizer = _tokenizer(args, run_tokenizer, trainer.model, str(config.model))
    ids = _prompt_ids(prompts, tokenizer, raw=args.raw)
    # phase_timing: the last line gives prefill's and decode's speeds apart.
    sampler = Sampler(
        trainer.model, trainer.plan, tokenizer=tokenizer, print_fn=note, phase_timing=True
    )
    new_tokens = _new_tokens(args, ids, sampler.context_length)
    end = args.end_token if args.end_token is not None else _end_token(tokenizer)
    vocabulary = _vocabulary(trainer.model) or getattr(tokenizer, "vocab_size", None)
    if args.end_token is not None and vocabulary and not 0 <= args.end_token < vocabulary:
        raise _Refused(
            f"--end_token={args.end_token} is not one of the model's token ids (0 to "
            f"{vocabulary - 1}); give the id that ends a document, or leave it out for the EOS."
        )
    note(
        f"generating from {source}: compiling the prefill and decode steps first (tens of "
        "seconds on a CPU, once per prompt length bucket)"
    )
    try:
        out: Generation = sampler.generate(
            ids, max_new_tokens=new_tokens, temperature=how.temperature, top_k=how.top_k,
            top_p=how.top_p, seed=args.seed, end_token=end, stop=args.stop,
        )  # fmt: skip
    except ValueError as error:  # a prompt longer than the context, a cache too large
        raise _Refused(str(error)) from None
    assert out.text is not None  # a tokenizer was given
    rows = [
        {"prompt": p, "text": t, "tokens": tokens, "log_probs": log_probs, "finish": finish,
         "source": source}
        for p, t, tokens, log_probs, finish in zip(
            prompts, out.text, out.tokens, out.log_probs, out.finish, strict=True
        )
    ]  # fmt: skip
    for i, row in enumerate(rows):
        if i and not args.json:  # a continuation may hold newlines: a blank line between
            print(flush=True)
        for line in _lines(row, args, tokenizer):
            print(line, flush=True)
    note(
        f"generated {sum(map(len, out.tokens))} tokens for {len(prompts)} "
        f"prompt{'s' if len(prompts) > 1 else ''}: prefill "
        f"{out.prefill_tokens_per_second:,.0f} tokens/s, decode "
        f"{out.decode_tokens_per_second:,.0f} tokens/s"
    )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Prints the continuations; returns 0, or exits 2 with one line."""
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.workdir is None and args.weights is None:
        fail(
            "generate: give the WORKDIR of a run, or --weights DIR (a Hugging Face GPT-2 "
            "folder: config.json, model.safetensors) with --tokenizer DIR/tokenizer.json."
        )
    workdir = Path(args.workdir or ".")
    if args.workdir is not None and not workdir.is_dir():
        fail(f"generate: there is no folder {workdir}; give the --workdir of a trained run.")
    if args.weights is None and not _saved_steps(workdir):
        fail(
            f"generate: no checkpoint in {workdir / 'checkpoints'}: train first (nnx-spmd-train "
            f"--workdir={workdir}), or give --weights FILE.safetensors."
        )
    if args.weights is not None and not Path(args.weights).exists():
        fail(f"generate: --weights={args.weights}: there is no file or folder there.")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        fail(f"generate: --max_new_tokens={args.max_new_tokens}; it must be >= 1.")
    try:  # the sampling keys and the prompts, before anything is built
        Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
        prompts_of(args)
    except (_Refused, ValueError) as error:
        fail(f"generate: {error}")
    try:
        config = hf_gpt2_config(Path(args.weights)) if args.workdir is None else None
    except _Refused as error:
        fail(f"generate: {error}")
    if config is None and not (workdir / "config.json").is_file():  # run_config says "evaluate"
        fail(
            f"generate: {workdir / 'config.json'} does not exist: {workdir} is not the --workdir "
            "of a run (nnx-spmd-train --workdir=DIR writes one)."
        )
    config = config or run_config(workdir, None)
    if args.workdir is None and args.tokenizer is None:  # a Hugging Face folder's own
        folder = Path(args.weights) if Path(args.weights).is_dir() else Path(args.weights).parent
        if (folder / "tokenizer.json").is_file():
            args.tokenizer = str(folder / "tokenizer.json")
    simulate_host_devices(config.get("num_devices", 8))  # before JAX starts its backend
    try:
        generate(args, config)
    except (_Refused, tasks.ConfigError, ShardingError, ValueError, TypeError) as error:
        fail(f"generate: {str(error).removeprefix('generate: ')}")  # the sampler's say it too
    return 0


if __name__ == "__main__":
    sys.exit(main())
