"""lm-evaluation-harness against a model on its training mesh: ``HarnessLM``.

``HarnessLM(trainer, tokenizer)`` is an ``lm_eval.api.model.LM``: ``lm_eval``'s tasks
(``lm_eval.simple_evaluate(model=HarnessLM(...), tasks=[...])``) score the trainer's
model where it is, with no export. Its three requests:

- ``loglikelihood(context, continuation)``: the continuation's summed log-probability,
  teacher-forced through ``Trainer.predict`` (the training layout's compiled forward
  pass, kept in the plan's cache), by the one chunked per-token log-probability
  (``score_tokens``: no ``[rows, positions, vocab]`` logits), and whether it is the
  greedy continuation;
- ``loglikelihood_rolling(text)``: the whole text's log-probability, in windows of the
  model's context as lm_eval's own models do (``get_rolling_token_windows``);
- ``generate_until(context, gen_kwargs)``: greedy continuations through
  ``generate.Sampler``, cut at the first ``until`` string.

Requests are scored in batches of ``batch_size`` rows, right padded to a power-of-two
length, so a task compiles a handful of programs, not one per request.

Needs the ``lm-eval`` extra: ``pip install 'nnx-spmd-trainer[lm-eval]'``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from nnx_spmd_trainer.generate.sampler import Sampler, TextCodec
from nnx_spmd_trainer.nn.logprob import DEFAULT_CHUNK_SIZE
from nnx_spmd_trainer.nn.logprob_model import model_token_scores

__all__ = ["HarnessLM", "score_tokens"]

Forward = Callable[[nnx.Module, jax.Array], jax.Array]
MIN_LENGTH = 16  # the shortest padded row: a power of two from here on
MISSING_LM_EVAL = (
    "HarnessLM needs lm-evaluation-harness, which is not installed: "
    "pip install 'nnx-spmd-trainer[lm-eval]'"
)


class _LMEvalMissing:
    """Stands in for ``lm_eval.api.model.LM`` where lm-eval is not installed: this module
    still imports (``score_tokens`` needs no lm_eval), and building a ``HarnessLM`` says
    which extra to install."""

    def __init__(self) -> None:
        raise ImportError(MISSING_LM_EVAL)


def _lm_base() -> type:
    try:
        from lm_eval.api.model import LM
    except ImportError:
        return _LMEvalMissing
    return LM


def score_tokens(
    forward: Forward | None = None, *, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> Callable[[nnx.Module, Any], dict[str, jax.Array]]:
    """A ``predict_fn`` for ``Trainer.predict`` over ``{"inputs", "targets"}`` batches
    (``[rows, positions]`` int32): each target's log-probability and whether it is the
    argmax, by the one per-token log-probability (``nn.logprob_model.model_token_scores``):
    through the model's hidden states and head, ``chunk_size`` positions at a time (the
    ``[rows, positions, vocab]`` logits never exist), or, with ``forward`` given (or a
    model without that protocol), from the whole logits."""

    def predict_fn(model: nnx.Module, batch: Any) -> dict[str, jax.Array]:
        log_prob, greedy = model_token_scores(
            model,
            batch["inputs"],
            batch["targets"],
            chunk_size=chunk_size,
            logits_fn=forward,
            greedy=True,
        )
        return {"log_prob": log_prob, "greedy": greedy}

    return predict_fn


def _padded_length(n: int, most: int) -> int:
    length = MIN_LENGTH
    while length < n:
        length *= 2
    return min(length, most)


class HarnessLM(_lm_base()):  # type: ignore[misc]
    """``trainer``'s model as an lm-evaluation-harness ``LM``.

    Args:
      trainer: a ``Trainer`` whose model maps ``[rows, positions]`` token ids to
        ``[rows, positions, vocab]`` logits (or give ``forward``).
      tokenizer: ``encode(text) -> ids`` and ``decode(ids) -> text`` (the run's).
      prefix_token: the token a text is predicted from when it has no context (the
        end-of-text token, lm_eval's ``eot_token_id``); default ``tokenizer.eos_id``.
      max_length: the most positions a row holds; default the model's context
        (``seq_len``, ``config.n_positions``). Longer contexts keep their end.
      batch_size: rows scored per compiled call.
      forward: ``(model, inputs) -> logits``, read whole; default: the model's hidden
        states and head, a chunk of positions at a time (``nn.logprob_model``'s protocol),
        or ``model(inputs)`` for a model without it.
      max_gen_toks: ``generate_until``'s length when a request does not say.

    Every process of a multi-process run must make the same calls (the forward pass runs
    on the whole mesh); each gets the same scores, and lm_eval reports on each.
    """

    def __init__(
        self,
        trainer: Any,  # a Trainer (the layer above this one: not imported)
        tokenizer: TextCodec,
        *,
        prefix_token: int | None = None,
        max_length: int | None = None,
        batch_size: int = 8,
        forward: Forward | None = None,
        max_gen_toks: int = 64,
    ) -> None:
        super().__init__()
        self.trainer = trainer
        self.tokenizer = tokenizer
        self.prefix_token = (
            prefix_token if prefix_token is not None else getattr(tokenizer, "eos_id", None)
        )
        self._sampler: Sampler | None = None
        self._context = max_length
        self.batch_size = batch_size
        self.max_gen_toks = max_gen_toks
        # One function object: Trainer.predict compiles it once per padded shape.
        self._score = score_tokens(forward)

    # -- what the model is -------------------------------------------------------------
    @property
    def sampler(self) -> Sampler:
        """The sampler ``generate_until`` runs (built on first use)."""
        if self._sampler is None:
            self._sampler = Sampler(
                self.trainer.model, self.trainer.plan, tokenizer=self.tokenizer, print_fn=None
            )
        return self._sampler

    @property
    def max_length(self) -> int:
        """The most positions a scored row holds."""
        if self._context is None:
            self._context = self.sampler.context_length or 2048
        return self._context

    def _encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text)]

    def _prefix(self) -> int:
        if self.prefix_token is None:
            raise ValueError(
                "HarnessLM: a request with no context needs the token a text starts from; "
                "give HarnessLM(..., prefix_token=<the end-of-text id>)."
            )
        return int(self.prefix_token)

    # -- scoring -------------------------------------------------------------------------
    def score(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """Each ``(context ids, continuation ids)``: the continuation's summed
        log-probability given the context, and whether every one of its tokens is the
        argmax. Contexts too long for ``max_length`` keep their end."""
        # Longest first, as lm_eval's own models order them: rows of a batch have like
        # lengths, so they pad little and the short batches share the small buckets.
        order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))
        out: list[tuple[float, bool]] = [(0.0, False)] * len(pairs)
        for start in range(0, len(order), self.batch_size):
            chosen = order[start : start + self.batch_size]
            scored = self._score_batch([pairs[i] for i in chosen])
            for i, result in zip(chosen, scored, strict=True):
                out[i] = result
        return out

    def _score_batch(
        self, pairs: Sequence[tuple[list[int], list[int]]]
    ) -> list[tuple[float, bool]]:
        rows = []
        for context, continuation in pairs:
            if not continuation:
                raise ValueError("HarnessLM: an empty continuation has no log-probability.")
            whole = (context + continuation)[-(self.max_length + 1) :]
            rows.append((whole[:-1], whole[1:], len(continuation)))
        length = _padded_length(max(len(r[0]) for r in rows), self.max_length)
        inputs = np.zeros((self.batch_size, length), np.int32)
        targets = np.zeros((self.batch_size, length), np.int32)
        for r, (row_inputs, row_targets, _) in enumerate(rows):
            inputs[r, : len(row_inputs)] = row_inputs
            targets[r, : len(row_targets)] = row_targets
        # Rows padded to a count the mesh splits (a "mask" marks them): any batch_size runs.
        batch = self.trainer.padded({"inputs": inputs, "targets": targets}, divisor=1)
        (scored,) = self.trainer.predict([batch], to_numpy=True, predict_fn=self._score)
        results = []
        for r, (row_inputs, _, scored_tokens) in enumerate(rows):
            end = len(row_inputs)
            span = slice(end - scored_tokens, end)
            results.append(
                (float(scored["log_prob"][r, span].sum()), bool(scored["greedy"][r, span].all()))
            )
        return results

    # -- lm_eval's requests --------------------------------------------------------------
    def _pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Context and continuation ids as lm_eval's own models split them: trailing
        spaces of the context move to the continuation, and the continuation is what the
        whole encodes to past the context's tokens."""
        moved = len(context) - len(context.rstrip())
        if moved:
            context, continuation = context[:-moved], context[-moved:] + continuation
        if not context:
            return [self._prefix()], self._encode(continuation)
        context_ids = self._encode(context)
        whole = self._encode(context + continuation)
        return context_ids, whole[len(context_ids) :]

    def loglikelihood(self, requests: list[Any]) -> list[tuple[float, bool]]:
        """``(summed log-probability, is greedy)`` of each request's continuation."""
        return self.score([self._pair(*request.args) for request in requests])

    def loglikelihood_rolling(self, requests: list[Any]) -> list[float]:
        """Each request's whole text's log-probability, window by window."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        windows: list[tuple[list[int], list[int]]] = []
        owners: list[int] = []  # the request each window belongs to
        for r, request in enumerate(requests):
            (text,) = request.args
            mine = [
                make_disjoint_window(window)
                for window in get_rolling_token_windows(
                    token_list=self._encode(text),
                    prefix_token=self._prefix(),
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            windows.extend(mine)
            owners.extend([r] * len(mine))
        totals = [0.0] * len(requests)
        for r, (logp, _) in zip(owners, self.score(windows), strict=True):
            totals[r] += logp  # the windows of all requests share batches
        return totals

    def generate_until(self, requests: list[Any]) -> list[str]:
        """Greedy continuations, stopped at the end-of-text token (``prefix_token``) and
        cut at the first of each request's ``until`` strings. Requests that ask alike
        are generated together, ``batch_size`` prompts a call."""
        groups: dict[tuple[tuple[str, ...], int], list[int]] = {}
        prompts: list[list[int]] = []
        for index, request in enumerate(requests):
            context, gen_kwargs = request.args
            until = gen_kwargs.get("until") or []
            until = (until,) if isinstance(until, str) else tuple(until)
            max_new = int(gen_kwargs.get("max_gen_toks", self.max_gen_toks))
            ids = self._encode(context) or [self._prefix()]
            room = self.sampler.context_length
            if room is not None:  # the prompt keeps its end, the continuation fits
                max_new = min(max_new, room - 1)
                ids = ids[-(room - max_new) :]
            prompts.append(ids)
            groups.setdefault((until, max_new), []).append(index)
        out = [""] * len(requests)
        for (until, max_new), indices in groups.items():
            for start in range(0, len(indices), self.batch_size):
                chosen = indices[start : start + self.batch_size]
                generated = self.sampler.generate(
                    [prompts[i] for i in chosen],
                    max_new_tokens=max_new,
                    stop=until,
                    end_token=self.prefix_token,
                )
                texts = generated.text or [""] * len(chosen)
                for i, text in zip(chosen, texts, strict=True):
                    for stop in until:
                        text = text.split(stop)[0]
                    out[i] = text
        return out
