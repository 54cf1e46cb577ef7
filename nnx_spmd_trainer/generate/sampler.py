"""Sampler: text from a trained model, on the mesh it trained on.

Example::

    sampler = Sampler(trainer.model, trainer.plan, tokenizer=tokenizer)
    out = sampler.generate(["Once upon"], max_new_tokens=32, temperature=0.8, top_p=0.95)
    out.text[0], out.log_probs[0][:3]

A call is one compiled program (``programs``): prefill, then every decode step in one
loop on the devices, the end token and the length decided there; the host reads the
tokens once a call. With stop strings (or ``phase_timing=True``) prefill and the loop are
two programs, and the host reads the tokens once a block of ``block_steps`` steps (it
checks the strings there). The conventions a model decodes in (the cache inside its
attention modules, Flax's; or the cache as an argument, jax-ml/bonsai's) are in
``decoding``; docs/topics/sampling.md. Prompts are left padded (``programs``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.profiler import TraceAnnotation

from nnx_spmd_trainer.data.to_host import gather_to_host
from nnx_spmd_trainer.generate.decoding import context_length as declared_context_length
from nnx_spmd_trainer.generate.memory import DecodeMemory, program_peak
from nnx_spmd_trainer.generate.programs import (
    Carry,
    DecodePrograms,
    Inputs,
    host_block,
    host_scalars,
    unpack,
)
from nnx_spmd_trainer.generate.results import (
    DecodeTiming,
    Generation,
    Rows,
    TextCodec,
    left_padded,
)
from nnx_spmd_trainer.generate.sampling import Sampling
from nnx_spmd_trainer.planner.plan import Plan

__all__ = ["CacheTooLarge", "DecodeMemory", "DecodeTiming", "Generation", "Sampler", "TextCodec"]

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


def _to_host(arrays: tuple[jax.Array, ...]) -> list[np.ndarray]:
    """``arrays`` whole on the host: copied where this process holds them all, else
    gathered from every process (``gather_to_host``, a collective)."""
    if all(x.is_fully_addressable for x in arrays):
        # np.asarray, not jax.device_get: on the CPU 2 us an array against 30 (its tree
        # walk and asynchronous copies), which at batch 1 is a tenth of a decode step.
        return [np.asarray(x) for x in arrays]
    return list(gather_to_host(arrays))


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
        what the model declares (``decoding.ContextLength``: a ``context_length``
        attribute), else unchecked.
      cache_dtype: the key-value cache's dtype.
      memory_budget_bytes: the most a device may give the cache; default what the device
        has free, where the backend says (else unchecked). A larger cache is refused
        (``CacheTooLarge``) before anything is compiled.
      print_fn: where the one line saying a layout was resharded goes (a pipeline's, a
        sequence split's: ``DecodePrograms.note``); ``None``: nowhere.
      init_cache: for a model that takes its cache as an argument (jax-ml/bonsai's
        convention: ``model(tokens, cache=..., segment_ids=...)``), what makes the cache:
        ``init_cache(batch_size, token_len, generate_steps, dtype)``, e.g.
        ``functools.partial(modeling.init_cache, model.config)``. ``None``: the model
        holds its cache in its attention modules (Flax's convention).
      block_steps: with stop strings, the decode steps between two reads of the tokens
        (where the host checks them); without, a call reads once.
      phase_timing: time prefill and decode apart (``Generation.prefill_tokens_per_second``
        and ``decode_tokens_per_second``): the two run as two programs, the devices waited
        for between them. ``False`` (default): a call without stop strings is one program,
        the fastest call, and only the whole call is timed (``tokens_per_second``).

    Example::

        sampler = Sampler(trainer.model, trainer.plan)
        sampler.generate([[1, 2, 3]], max_new_tokens=4).tokens  # greedy: [[...4 ids]]

    With several processes, every process makes the same ``generate`` calls (the programs
    run on the whole mesh) and gets every row back (the tokens are gathered where the
    host reads them: once a call, or once a block of steps).
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
        init_cache: Callable[..., Any] | None = None,
        block_steps: int = 16,
        phase_timing: bool = False,
    ) -> None:
        if block_steps < 1:
            raise ValueError(f"Sampler: block_steps={block_steps}; it must be >= 1.")
        self.memory_budget_bytes = memory_budget_bytes
        self.block_steps = block_steps
        self.phase_timing = phase_timing
        self.programs = DecodePrograms(model, plan, cache_dtype=cache_dtype, init_cache=init_cache)
        if self.programs.note and print_fn is not None:
            print_fn(self.programs.note)
        self.tokenizer = tokenizer
        self.context_length = context_length or declared_context_length(model)
        #: Where the last ``generate`` call's time went (``None`` before the first).
        self.last_timing: DecodeTiming | None = None
        self._device_says_free = True

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

    def memory(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        sampling: Sampling | None = None,
    ) -> DecodeMemory:
        """What a ``generate`` of ``prompts`` holds on each device, before it runs: the
        prefill and decode programs' peaks and the peak of the two as one program (what a
        call without stop strings runs; the compiler's memory analysis; the programs are
        compiled now and kept for the call; those of a call without an end token, which
        one with it equals but for a reduction) with the cache's and the model's bytes."""
        rows, columns, length = self.bucket(self._encoded(prompts), max_new_tokens)
        how = sampling or Sampling()
        programs = self.programs
        state = sum(
            math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
            for x in programs.state_leaves()
        )
        return DecodeMemory(
            rows, columns, length,
            cache_bytes=programs.cache_bytes_per_device(rows, length),
            state_bytes=int(state),
            prefill_peak=program_peak(programs.prefill(rows, columns, length, how)),
            decode_peak=program_peak(programs.decode(rows, length, how, ends=False)),
            call_peak=program_peak(programs.whole(rows, columns, length, how, ends=False)),
        )  # fmt: skip

    def _check_fits(self, rows: int, length: int) -> None:
        budget = self.memory_budget_bytes
        if budget is None and self._device_says_free:
            budget = _free_device_bytes(list(self.programs.plan.mesh.devices.flat))
            # A backend that does not say (the CPU) is not asked again each call.
            self._device_says_free = budget is not None
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
        tokens, positions, real, lengths = left_padded(ids, rows, columns, length)
        programs, leaves = self.programs, self.programs.state_leaves()
        ends = end_token is not None  # else no row stops on the device: it runs to `until`
        timing = DecodeTiming(prompt_tokens=int(sum(len(p) for p in ids)), prompts=n)
        out = Rows(n, end_token, stop, self.tokenizer)
        active = np.arange(rows) < n
        # TraceAnnotation: a profile (jax.profiler) shows the call.
        if stop or self.phase_timing or max_new_tokens == 1:
            # Host arrays go to prefill as they are (a compiled call places its arguments
            # itself, cheaper than placing them first); it hands them on to the decode loop.
            inputs = Inputs(
                lengths, real, np.uint32(seed), np.arange(rows, dtype=np.int32),
                np.int32(-1 if end_token is None else end_token),
            )  # fmt: skip
            arguments = (leaves, tokens, positions, active, inputs)
            with jax.set_mesh(programs.plan.mesh), TraceAnnotation("generate"):
                start = time.perf_counter()
                step = self._phases(arguments, out, timing, rows, columns, length, how, ends,
                                    max_new_tokens, bool(stop))  # fmt: skip
        else:  # one program, two host arrays in, one read (no mesh context: it is compiled)
            block = host_block(tokens, positions, real, active, lengths)
            scalars = host_scalars(seed, end_token, max_new_tokens)
            whole = programs.whole(rows, columns, length, how, ends=ends)
            with TraceAnnotation("generate"):
                start = time.perf_counter()
                step, _, _ = self._read(whole(leaves, block, scalars), how, out)
            timing.one_program = True
        timing.call_seconds = time.perf_counter() - start
        timing.decode_steps = step - 1
        timing.decode_tokens = n * timing.decode_steps
        self.last_timing = timing
        if logger.isEnabledFor(logging.INFO):  # the line is built only to be logged
            logger.info(
                "generate: %d prompts (%d rows x %d columns, cache of %d): %s", n, rows,
                columns, length, timing.line(),
            )  # fmt: skip
        return out.result(timing)

    def _read(self, carry: Any, how: Sampling, out: Rows) -> tuple[int, np.ndarray, bool]:
        """Reads a program's ``carry`` (a ``Carry``, or ``whole``'s packed array) back to
        the host into ``out`` (the stop strings checked); returns the step it reached,
        each row's done (the host's stops marked) and whether the host stopped a row now."""
        if isinstance(carry, Carry):
            step_array, done, taken, *buffers = _to_host(
                (carry.step, carry.done, carry.taken, *carry.out[: 2 if how.greedy else 4])
            )
            step = int(step_array)
        else:  # the one program's packed result: one read
            step, done, taken, buffers = unpack(_to_host((carry,))[0], how.greedy)
        if how.greedy:  # the decode loop wrote tokens and log-probabilities only
            buffers += [buffers[1], np.full_like(buffers[1], -np.inf)]
        n = out.n
        stopped = out.take(taken[:n], tuple(b[:n] for b in buffers))
        done = np.array(done)
        done[:n] |= stopped
        return step, done, bool(stopped.any())

    def _phases(
        self, arguments: tuple[Any, ...], out: Rows, timing: DecodeTiming, rows: int,
        columns: int, length: int, how: Sampling, ends: bool, max_new_tokens: int,
        blocks: bool,
    ) -> int:  # fmt: skip
        """Prefill, then the decode loop, as two programs, each timed (``blocks``: the
        loop in blocks of ``block_steps``, the stop strings checked between); returns the
        step reached."""
        programs, leaves = self.programs, arguments[0]
        prefill = programs.prefill(rows, columns, length, how)
        decode = programs.decode(rows, length, how, ends=ends) if max_new_tokens > 1 else None
        block = self.block_steps if blocks else max_new_tokens
        start = time.perf_counter()
        cache, carry, inputs = prefill(*arguments)
        first = carry

        def run_block(cache: Any, carry: Any, until: int) -> tuple[Any, Any]:
            assert decode is not None
            return decode(leaves, cache, carry, inputs, np.int32(until))

        # The first block is dispatched before prefill's result is waited for: the
        # devices go from one program to the next with no host work between.
        if decode is not None:
            cache, carry = run_block(cache, carry, min(block, max_new_tokens))
        jax.block_until_ready(first.token)
        block_start = loop_start = time.perf_counter()
        timing.prefill_seconds = loop_start - start
        while True:
            carry = jax.block_until_ready(carry)
            if decode is not None:
                timing.decode_seconds += time.perf_counter() - block_start
                timing.blocks += 1
            step, done, stopped = self._read(carry, how, out)
            if decode is None or done.all() or step >= max_new_tokens:
                break
            if stopped:  # the host's stops, marked done on the device
                (done_array,) = programs.on_devices(done)
                carry = carry._replace(done=done_array)
            block_start = time.perf_counter()
            cache, carry = run_block(cache, carry, min(step + block, max_new_tokens))
        timing.decode_loop_seconds = time.perf_counter() - loop_start
        return step
