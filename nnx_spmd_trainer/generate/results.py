"""The host's side of a ``generate`` call: the prompts laid out for the programs, the
rows read back (stop strings checked where the host reads them), what is returned."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

__all__ = ["DecodeTiming", "Generation", "TextCodec", "left_padded"]


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
        prefill program's wall time (dispatch to result, compilation not counted); ``0.0``
        where prefill and decode ran as one program (``Sampler(phase_timing=False)``, a
        call without stop strings).
      decode_tokens_per_second: the tokens the decode steps produced for the prompts
        (one per prompt and step, the first token of each row being prefill's) over the
        decode programs' wall time; ``0.0`` when no decode step ran (``max_new_tokens=1``)
        or the two phases ran as one program.
      tokens_per_second: the tokens generated for the prompts (one per prompt and step,
        prefill's first included) over the whole call's wall time, the host's work
        included (the prompts in, the tokens read back).
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
    tokens_per_second: float = 0.0


@dataclasses.dataclass
class DecodeTiming:
    """Where one ``generate`` call's time went (``Sampler.last_timing``): what
    ``Generation``'s tokens per second are computed from.

    Attributes:
      prompt_tokens: the prompts' tokens (padding not counted).
      prefill_seconds: the prefill program, from its call to its result (``0.0`` where
        ``one_program``).
      decode_steps: the decode steps run (the first token of each row is prefill's).
      decode_tokens: the tokens they produced for the prompts (prompts x steps).
      decode_seconds: the decode programs (one a call, or one a block of steps where
        stop strings are checked), each from its call, or from the result before it, to
        its result.
      decode_loop_seconds: the whole decode phase, the host's work included (placing
        the inputs, reading the tokens back, the stop checks).
      blocks: the decode programs run (1 a call without stop strings; 0 where
        ``one_program``).
      one_program: prefill and the decode loop ran as one program, its phases not timed
        apart (``decode_seconds`` and ``decode_loop_seconds`` are then ``0.0``).
      call_seconds: the whole call, from the first program's call to the tokens read
        back.
      prompts: the prompts (the rows that are not padding).
    """

    prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    decode_loop_seconds: float = 0.0
    blocks: int = 0
    one_program: bool = False
    call_seconds: float = 0.0
    prompts: int = 0

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def tokens(self) -> int:
        """The tokens generated for the prompts: prefill's first and one a decode step."""
        return self.prompts * (self.decode_steps + 1)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.call_seconds if self.call_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    def line(self) -> str:
        """One line: the tokens, seconds and tokens per second of each phase (of the whole
        call where they ran as one program)."""
        call = (
            f"{self.tokens} tokens for {self.prompts} prompts ({self.prompt_tokens} prompt "
            f"tokens) in {self.call_seconds:.4f} s ({self.tokens_per_second:.1f} tokens/s)"
        )
        if self.one_program:
            return call + ", prefill and decode in one program"
        return (
            f"{call}: prefill {self.prefill_seconds:.4f} s "
            f"({self.prefill_tokens_per_second:.1f} tokens/s), decode {self.decode_tokens} "
            f"tokens in {self.decode_steps} steps, {self.decode_seconds:.4f} s "
            f"({self.decode_tokens_per_second:.1f} tokens/s)"
        )


def left_padded(
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


class Rows:
    """The generated rows on the host, read from the programs' buffers: what each row
    took and why it stopped (end token: on the device; stop strings: checked here)."""

    def __init__(
        self, n: int, end_token: int | None, stop: Sequence[str], tokenizer: TextCodec | None
    ) -> None:
        self.n, self.end_token, self.stop, self.tokenizer = n, end_token, tuple(stop), tokenizer
        self.count = np.zeros(n, np.int64)
        self.stopped = np.zeros(n, bool)  # by a stop string
        self.buffers: tuple[np.ndarray, ...] = ()

    def take(self, count: np.ndarray, buffers: tuple[np.ndarray, ...]) -> np.ndarray:
        """Reads a block's result (each row's token count and the ``[rows, width]``
        buffers); checks the stop strings on the tokens new to each row. Returns the
        rows the host stopped now (to mark done on the device)."""
        self.buffers = buffers
        newly = np.zeros(len(count), bool)
        for r in range(self.n):
            seen, now = int(self.count[r]), int(count[r])
            if self.stopped[r]:
                continue
            if self.stop and self.tokenizer is not None:
                for k in range(seen + 1, now + 1):
                    text = self.tokenizer.decode(buffers[0][r, :k].tolist())
                    if any(s in text for s in self.stop):
                        now, self.stopped[r], newly[r] = k, True, True
                        break
            self.count[r] = now
        return newly

    def _finish(self, r: int) -> str:
        if self.stopped[r]:
            return "stop"
        ids = self.buffers[0][r, : self.count[r]]
        ended = self.end_token is not None and len(ids) and int(ids[-1]) == self.end_token
        return "end" if ended else "length"

    def _text(self, r: int, ids: list[int], finish: str) -> str:
        assert self.tokenizer is not None
        text = self.tokenizer.decode(ids[:-1] if finish == "end" else ids)
        cuts = [text.index(s) for s in self.stop if s in text]
        return text[: min(cuts)] if cuts else text

    def result(self, timing: DecodeTiming) -> Generation:
        columns = [[b[r, : self.count[r]].tolist() for r in range(self.n)] for b in self.buffers]
        tokens, log_probs, sampling_log_probs, kept = columns
        finish = [self._finish(r) for r in range(self.n)]
        text = None
        if self.tokenizer is not None:
            text = [self._text(r, tokens[r], finish[r]) for r in range(self.n)]
        return Generation(
            tokens,
            log_probs,
            text,
            finish,
            prefill_tokens_per_second=timing.prefill_tokens_per_second,
            decode_tokens_per_second=timing.decode_tokens_per_second,
            tokens_per_second=timing.tokens_per_second,
            sampling_log_probs=sampling_log_probs,
            kept_min_logit=kept,
        )
