"""Sampler: text from a trained model, on the mesh it trained on.

Example::

    sampler = Sampler(trainer.model, trainer.plan, tokenizer=tokenizer)
    out = sampler.generate(["Once upon"], max_new_tokens=32, temperature=0.8, top_p=0.95)
    out.text[0], out.log_probs[0][:3]

The contract a model meets (docs/topics/sampling.md): its attention decodes in
Flax's convention (``nnx.MultiHeadAttention``: a ``decode`` attribute and
``init_cache``), and it is called ``model(tokens, positions=..., mask=...)`` with
a block of tokens (``[rows, positions]``: the whole left-padded prompt block at
prefill where every attention takes a block, ``nn.kv_cache.decodes_blocks``, else
one column at a time; one column a decode step), each token's position, and the
cached keys each row may attend to (``[rows, 1, 1, cache_length]``), returning
logits ``[rows, positions, vocab]``. Prompts are left padded (``programs``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.profiler import TraceAnnotation

from nnx_spmd_trainer.data.to_host import gather_to_host
from nnx_spmd_trainer.generate.programs import DecodePrograms
from nnx_spmd_trainer.generate.sampling import Sampling
from nnx_spmd_trainer.planner.plan import Plan

__all__ = ["CacheTooLarge", "DecodeTiming", "Generation", "Sampler", "TextCodec"]

logger = logging.getLogger(__name__)

#: Prompt columns and cache lengths are rounded up to a multiple of this: one
#: compiled prefill and decode serve every batch in the bucket.
BUCKET = 16


class CacheTooLarge(ValueError):
    """A generate call whose key-value cache would not fit a device: refused before
    anything is compiled or allocated, with the numbers."""


def _free_device_bytes(devices: Sequence[jax.Device]) -> int | None:
    """The least any of this process's ``devices`` has free (limit minus in use), where
    the backend says (GPUs, TPUs); ``None`` where it does not (the CPU)."""
    free = []
    for device in devices:
        if device.process_index != jax.process_index():
            continue
        stats = device.memory_stats()
        if stats and "bytes_limit" in stats:
            free.append(int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)))
    return min(free, default=None)


class TextCodec(Protocol):
    """What the sampler needs of a tokenizer (``data.Tokenizer`` is one)."""

    def encode(self, text: str) -> Any: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclasses.dataclass(frozen=True)
class Generation:
    """What ``Sampler.generate`` returns, one entry per prompt.

    Attributes:
      tokens: the generated token ids (an end token that stopped a row included).
      log_probs: each generated token's log-probability under the model's raw logits
        (``log_softmax``, float32), whatever the sampling settings.
      text: the generated text through the tokenizer (the end token and anything from
        a stop string on left out); ``None`` without a tokenizer.
      finish: why each row stopped: ``"end"``, ``"stop"`` (a stop string) or ``"length"``.
      prefill_tokens_per_second: the prompts' tokens (padding not counted) over the
        prefill program's wall time (dispatch to result, compilation not counted).
      decode_tokens_per_second: the tokens the decode steps produced for the prompts
        (one per prompt and step, the first token of each row being prefill's) over the
        decode programs' wall time (each call to its result); ``0.0`` when no decode
        step ran (``max_new_tokens=1``).
      sampling_log_probs: each generated token's log-probability under the distribution
        it was drawn from: the logits divided by the temperature, renormalised over the
        tokens top-k/top-p kept (``sampling.choose``). Equal to ``log_probs`` when greedy
        and at ``temperature=1`` with no truncation. What a policy-gradient learner's
        first-update ratio is measured against.
      kept_min_logit: per generated token, the smallest temperature-scaled logit the
        truncation kept (``-inf`` when nothing was truncated): a learner rebuilds the
        kept set as the tokens whose ``logit / temperature`` is at least this.
    """

    tokens: list[list[int]]
    log_probs: list[list[float]]
    text: list[str] | None
    finish: list[str]
    prefill_tokens_per_second: float = 0.0
    decode_tokens_per_second: float = 0.0
    sampling_log_probs: list[list[float]] = dataclasses.field(default_factory=list)
    kept_min_logit: list[list[float]] = dataclasses.field(default_factory=list)


def _context_length(model: nnx.Module) -> int | None:
    """The positions a shipped model was built for (GPT's ``seq_len``, GPT-2's
    ``config.n_positions``), else ``None``."""
    for owner, name in ((model, "seq_len"), (getattr(model, "config", None), "n_positions")):
        value = getattr(owner, name, None)
        if isinstance(value, int):
            return value
    return None


def _round_up(n: int, multiple: int) -> int:
    return max(multiple, math.ceil(n / multiple) * multiple)


class Sampler:
    """Generates from ``model`` laid out by ``plan``, never writing the model's state.

    Args:
      model: the trained ``nnx.Module`` (``trainer.model``), its arrays on ``plan.mesh``.
      plan: the plan it trains with (``trainer.plan``); the programs are compiled through
        it and kept in its cache.
      tokenizer: encodes string prompts and decodes the output (``encode``/``decode``).
      context_length: the most positions the model takes (prompt + generated); default
        read from the model (``seq_len``, ``config.n_positions``), else unchecked.
      cache_dtype: the key-value cache's dtype.
      memory_budget_bytes: the most a device may give the cache; default what the device
        has free, where the backend says (else unchecked). A larger cache is refused
        (``CacheTooLarge``) before anything is compiled.
      print_fn: where the one line saying a layout was resharded goes (a pipeline's, a
        sequence split's: ``DecodePrograms.note``); ``None``: nowhere.

    Example::

        sampler = Sampler(trainer.model, trainer.plan)
        sampler.generate([[1, 2, 3]], max_new_tokens=4).tokens  # greedy: [[...4 ids]]

    With several processes, every process makes the same ``generate`` calls (the programs
    run on the whole mesh) and gets every row back (each step's tokens are gathered).
    """

    def __init__(
        self,
        model: nnx.Module,
        plan: Plan,
        *,
        tokenizer: TextCodec | None = None,
        context_length: int | None = None,
        cache_dtype: Any = jnp.float32,
        memory_budget_bytes: int | None = None,
        print_fn: Callable[[str], None] | None = print,
    ) -> None:
        self.memory_budget_bytes = memory_budget_bytes
        self.programs = DecodePrograms(model, plan, cache_dtype=cache_dtype)
        if self.programs.note and print_fn is not None:
            print_fn(self.programs.note)
        self.tokenizer = tokenizer
        self.context_length = context_length or _context_length(model)
        #: Where the last ``generate`` call's time went (``None`` before the first).
        self.last_timing: DecodeTiming | None = None

    def _encoded(self, prompts: Sequence[str] | Sequence[Sequence[int]]) -> list[list[int]]:
        if not prompts:
            raise ValueError("generate: no prompts; give at least one.")
        out = []
        for prompt in prompts:
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise TypeError(
                        "generate: a text prompt needs a tokenizer: Sampler(..., tokenizer=...) "
                        "or give token ids."
                    )
                prompt = [int(t) for t in self.tokenizer.encode(prompt)]
            ids = [int(t) for t in prompt]
            if not ids:
                raise ValueError("generate: an empty prompt; every prompt needs a token.")
            out.append(ids)
        return out

    def bucket(self, prompts: list[list[int]], max_new_tokens: int) -> tuple[int, int, int]:
        """``(rows, prompt columns, cache length)`` the programs are compiled for."""
        rows = _round_up(len(prompts), self.programs.row_multiple)
        columns = _round_up(max(len(p) for p in prompts), BUCKET)
        return rows, columns, _round_up(columns + max_new_tokens, BUCKET)

    def cache_bytes(
        self, prompts: Sequence[str] | Sequence[Sequence[int]], *, max_new_tokens: int
    ) -> int:
        """The bytes of key-value cache each device holds to continue ``prompts`` by
        ``max_new_tokens`` (the bucket's rows and length, laid out as it will be)."""
        rows, _, length = self.bucket(self._encoded(prompts), max_new_tokens)
        return self.programs.cache_bytes_per_device(rows, length)

    def _check_fits(self, rows: int, length: int) -> None:
        budget = self.memory_budget_bytes
        if budget is None:
            budget = _free_device_bytes(list(self.programs.plan.mesh.devices.flat))
        if budget is None:
            return
        need = self.programs.cache_bytes_per_device(rows, length)
        if need > budget:
            raise CacheTooLarge(
                f"generate: the key-value cache for {rows} rows x {length} positions needs "
                f"{need:,} bytes per device, more than the {budget:,} it may have; give fewer "
                "prompts at a time, fewer max_new_tokens, a smaller cache_dtype, or a layout "
                "that splits more rows or heads."
            )

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        end_token: int | None = None,
        stop: Sequence[str] = (),
    ) -> Generation:
        """Continues each prompt (text or token ids) by up to ``max_new_tokens``.

        Greedy at ``temperature=0``; else drawn after ``top_k``/``top_p`` truncation
        (``Sampling``), each row from its own key (``sampling.row_key``): the same
        ``seed`` gives the same tokens under any strategy and device count. A row stops
        at ``end_token``, at a ``stop`` string (through the tokenizer), or at the length.
        """
        how = Sampling(temperature=temperature, top_k=top_k, top_p=top_p)
        if max_new_tokens < 1:
            raise ValueError(f"generate: max_new_tokens={max_new_tokens}; it must be >= 1.")
        if stop and self.tokenizer is None:
            raise TypeError("generate: stop strings need a tokenizer: Sampler(..., tokenizer=...).")
        ids = self._encoded(prompts)
        longest = max(len(p) for p in ids)
        if self.context_length is not None and longest + max_new_tokens > self.context_length:
            raise ValueError(
                f"generate: a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} "
                f"is more than the model's context of {self.context_length} positions; shorten "
                "the prompt or ask for fewer tokens."
            )
        rows, columns, length = self.bucket(ids, max_new_tokens)
        self._check_fits(rows, length)
        return self._run(ids, rows, columns, length, how, seed, max_new_tokens, end_token, stop)

    def _run(
        self,
        ids: list[list[int]],
        rows: int,
        columns: int,
        length: int,
        how: Sampling,
        seed: int,
        max_new_tokens: int,
        end_token: int | None,
        stop: Sequence[str],
    ) -> Generation:
        n = len(ids)
        tokens, positions, real, lengths = _left_padded(ids, rows, columns, length)
        row_ids = np.arange(rows, dtype=np.int32)  # a prompt's index: its keys' third input
        programs, leaves = self.programs, self.programs.state_leaves()
        prefill = programs.prefill(rows, columns, length, how)
        decode = programs.decode(rows, length, how)
        timing = DecodeTiming(prompt_tokens=int(sum(len(p) for p in ids)))
        # TraceAnnotations: a profile (jax.profiler) shows each phase and decode step.
        with jax.set_mesh(programs.plan.mesh), TraceAnnotation("generate/prefill"):
            seed_array, real_array, lengths_array, row_array = programs.on_devices(
                np.uint32(seed), real, lengths, row_ids
            )
            start = time.perf_counter()
            cache, choice = jax.block_until_ready(
                prefill(leaves, tokens, positions, real_array, seed_array, row_array)
            )
            timing.prefill_seconds = time.perf_counter() - start
            out = _Rows(n, end_token, stop, self.tokenizer)
            done = out.take(*gather_to_host(tuple(choice)))
        loop_start = time.perf_counter()
        with jax.set_mesh(programs.plan.mesh):
            for step in range(1, max_new_tokens):
                if done:
                    break
                with TraceAnnotation("generate/decode_step"):
                    start = time.perf_counter()
                    cache, choice = jax.block_until_ready(
                        decode(
                            leaves, cache, choice.token, lengths_array, real_array,
                            seed_array, np.int32(step), row_array,
                        )
                    )  # fmt: skip
                    timing.decode_seconds += time.perf_counter() - start
                    timing.decode_steps += 1
                    done = out.take(*gather_to_host(tuple(choice)))
        timing.decode_loop_seconds = time.perf_counter() - loop_start
        timing.decode_tokens = n * timing.decode_steps
        self.last_timing = timing
        logger.info(
            "generate: %d prompts (%d rows x %d columns, cache of %d): %s", n, rows, columns,
            length, timing.line(),
        )  # fmt: skip
        return out.result(timing)


@dataclasses.dataclass
class DecodeTiming:
    """Where one ``generate`` call's time went (``Sampler.last_timing``): what
    ``Generation``'s tokens per second are computed from.

    Attributes:
      prompt_tokens: the prompts' tokens (padding not counted).
      prefill_seconds: the prefill program, from its call to its result.
      decode_steps: the decode steps run (the first token of each row is prefill's).
      decode_tokens: the tokens they produced for the prompts (prompts x steps).
      decode_seconds: the decode programs, each from its call to its result.
      decode_loop_seconds: the whole loop of decode steps, the host's work included
        (the inputs, reading each step's tokens back, the stop checks).
    """

    prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    decode_loop_seconds: float = 0.0

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    def line(self) -> str:
        """One line: the tokens, seconds and tokens per second of each phase."""
        return (
            f"prefill {self.prompt_tokens} tokens in {self.prefill_seconds:.4f} s "
            f"({self.prefill_tokens_per_second:.1f} tokens/s), decode {self.decode_tokens} "
            f"tokens in {self.decode_steps} steps, {self.decode_seconds:.4f} s "
            f"({self.decode_tokens_per_second:.1f} tokens/s)"
        )


def _left_padded(
    ids: list[list[int]], rows: int, columns: int, length: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The prompts left padded into ``rows x columns`` (padding rows: one token), each
    row's positions from its own first token, the cache positions each row may attend
    to (``rows x length``: its prompt and everything generated), and each row's length."""
    tokens = np.zeros((rows, columns), np.int32)
    positions = np.zeros((rows, columns), np.int32)
    real = np.zeros((rows, length), bool)
    real[:, columns:] = True  # what is generated is always attended to
    padded = ids + [[0]] * (rows - len(ids))
    for r, prompt in enumerate(padded):
        tokens[r, columns - len(prompt) :] = prompt
        positions[r, columns - len(prompt) :] = np.arange(len(prompt))
        real[r, columns - len(prompt) : columns] = True
    return tokens, positions, real, np.array([len(p) for p in padded], np.int32)


class _Rows:
    """The generated rows on the host: what each row took and whether it stopped."""

    def __init__(
        self, n: int, end_token: int | None, stop: Sequence[str], tokenizer: TextCodec | None
    ) -> None:
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.log_probs: list[list[float]] = [[] for _ in range(n)]
        self.sampling_log_probs: list[list[float]] = [[] for _ in range(n)]
        self.kept_min_logit: list[list[float]] = [[] for _ in range(n)]
        self.finish = ["length"] * n
        self.done = [False] * n
        self.end_token, self.stop, self.tokenizer = end_token, tuple(stop), tokenizer

    def take(
        self, token: np.ndarray, logp: np.ndarray, sampling_logp: np.ndarray, kept: np.ndarray
    ) -> bool:
        """Adds one step's tokens; True once every row has stopped."""
        for r in range(len(self.tokens)):
            if self.done[r]:
                continue
            self.tokens[r].append(int(token[r]))
            self.log_probs[r].append(float(logp[r]))
            self.sampling_log_probs[r].append(float(sampling_logp[r]))
            self.kept_min_logit[r].append(float(kept[r]))
            if self.end_token is not None and int(token[r]) == self.end_token:
                self.done[r], self.finish[r] = True, "end"
            elif self.stop and self.tokenizer is not None:
                text = self.tokenizer.decode(self.tokens[r])
                if any(s in text for s in self.stop):
                    self.done[r], self.finish[r] = True, "stop"
        return all(self.done)

    def _text(self, r: int) -> str:
        assert self.tokenizer is not None
        ids = self.tokens[r]
        if self.finish[r] == "end":
            ids = ids[:-1]
        text = self.tokenizer.decode(ids)
        cuts = [text.index(s) for s in self.stop if s in text]
        return text[: min(cuts)] if cuts else text

    def result(self, timing: DecodeTiming) -> Generation:
        text = None if self.tokenizer is None else [self._text(r) for r in range(len(self.tokens))]
        return Generation(
            self.tokens,
            self.log_probs,
            text,
            self.finish,
            prefill_tokens_per_second=timing.prefill_tokens_per_second,
            decode_tokens_per_second=timing.decode_tokens_per_second,
            sampling_log_probs=self.sampling_log_probs,
            kept_min_logit=self.kept_min_logit,
        )
