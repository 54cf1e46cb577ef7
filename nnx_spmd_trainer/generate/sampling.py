"""Choosing the next token: pure functions of float32 logits and a key.

Each row draws from its own key, ``row_key(seed, step, row)``: ``jax.random.fold_in``
of the seed by the decode step and the prompt's index. No random op ever runs over
a sharded array, so the same seed gives the same tokens however the rows are laid
out: under any strategy, on one device or eight.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from nnx_spmd_trainer.nn.logprob import scores_from_logits

__all__ = ["Choice", "Sampling", "choose", "row_key", "sample"]


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen from the logits.

    ``temperature=0`` is greedy (the argmax, no key read); otherwise the logits are
    divided by ``temperature``, cut to the ``top_k`` largest (``0``: all) and to the
    smallest set whose probability reaches ``top_p`` (``1.0``: all), and one token is
    drawn.

    >>> Sampling(temperature=0.8, top_k=40, top_p=0.95).greedy
    False
    >>> Sampling(top_p=0.0)
    Traceback (most recent call last):
    ...
    ValueError: Sampling: top_p=0.0 is outside (0, 1]; 1.0 keeps every token.
    >>> Sampling(temperature=float("nan"))
    Traceback (most recent call last):
    ...
    ValueError: Sampling: temperature=nan is not a number; 0 is greedy, 1 samples.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(
                f"Sampling: top_p={self.top_p} is outside (0, 1]; 1.0 keeps every token."
            )
        if not math.isfinite(self.temperature):  # nan passes every comparison below
            raise ValueError(
                f"Sampling: temperature={self.temperature} is not a number; 0 is greedy, 1 samples."
            )
        if self.temperature < 0.0:
            raise ValueError(f"Sampling: temperature={self.temperature} is negative; 0 is greedy.")
        if self.top_k < 0:
            raise ValueError(f"Sampling: top_k={self.top_k} is negative; 0 keeps every token.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def row_key(seed: jax.Array | int, step: jax.Array | int, row: jax.Array | int) -> jax.Array:
    """The key of one row at one decode step: the same for a prompt wherever it sits.

    >>> bool((row_key(0, 1, 2) == row_key(0, 1, 2)).all())
    True
    """
    key = jax.random.fold_in(jax.random.key(seed), step)
    return jax.random.fold_in(key, row)


def _kept_min(scaled: jax.Array, sampling: Sampling) -> jax.Array:
    """The smallest of one row's temperature-scaled logits (``[vocab]``, float32) that
    top-k and top-p keep; ``-inf`` when they keep every token. The kept set is every
    token at or above it (ties with it included), as a learner rebuilds it."""
    keep = jnp.ones(scaled.shape, bool)
    if sampling.top_k and sampling.top_k < scaled.shape[-1]:
        kth = jax.lax.top_k(scaled, sampling.top_k)[0][-1]
        keep = scaled >= kth
    if sampling.top_p < 1.0:
        masked = jnp.where(keep, scaled, -jnp.inf)
        order = jnp.argsort(-masked)
        probabilities = jax.nn.softmax(masked[order])
        before = jnp.cumsum(probabilities) - probabilities  # mass of the tokens ranked above
        keep_sorted = before < sampling.top_p  # the first token is always kept
        keep = keep & jnp.zeros_like(keep_sorted).at[order].set(keep_sorted)
    smallest = jnp.min(jnp.where(keep, scaled, jnp.inf))
    return jnp.where(jnp.all(keep), -jnp.inf, smallest)


def _truncated(logits: jax.Array, sampling: Sampling) -> jax.Array:
    """``logits`` (one row, float32, temperature-scaled) with the tokens outside top-k
    and top-p at -inf."""
    return jnp.where(logits >= _kept_min(logits, sampling), logits, -jnp.inf)


class Choice(NamedTuple):
    """One decode step's choice for a row (or rows, under ``vmap``).

    Attributes:
      token: the chosen id.
      log_prob: its log-probability under the model's raw logits (``log_softmax``).
      sampling_log_prob: its log-probability under the distribution it was drawn from:
        ``logits / temperature``, renormalised over the tokens top-k/top-p kept (those at
        or above ``kept_min_logit``). Equal to ``log_prob`` when greedy, and at
        ``temperature=1`` with nothing truncated.
      kept_min_logit: the smallest temperature-scaled logit kept; ``-inf`` when nothing
        was truncated (greedy included).
    """

    token: jax.Array
    log_prob: jax.Array
    sampling_log_prob: jax.Array
    kept_min_logit: jax.Array


def choose(logits: jax.Array, key: jax.Array, sampling: Sampling) -> Choice:
    """One token from one row's ``logits`` (``[vocab]``) with ``key``, and the
    log-probabilities it has under the model and under the sampling distribution.

    >>> p = jnp.array([0.5, 0.3, 0.2])
    >>> c = choose(jnp.log(p), row_key(0, 0, 0), Sampling(1.0, top_k=2))
    >>> bool(c.kept_min_logit == jnp.log(p)[1]), int(c.token) in (0, 1)
    (True, True)
    >>> bool(jnp.isclose(c.sampling_log_prob, jnp.log(p[c.token] / 0.8)))
    True
    """
    # Both log-probabilities are read as the learner reads them (nn.logprob's one
    # implementation), so a GRPO ratio starts at 1 to the last bit the formula allows.
    logits = logits.astype(jnp.float32)
    if sampling.greedy:
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        raw = scores_from_logits(logits, token)[0]
        return Choice(token, raw, raw, jnp.float32(-jnp.inf))
    scaled = logits / sampling.temperature
    kept_min = _kept_min(scaled, sampling)
    # categorical normalises itself: the truncated, tempered logits are the distribution.
    token = jax.random.categorical(key, jnp.where(scaled >= kept_min, scaled, -jnp.inf))
    token = token.astype(jnp.int32)
    raw = scores_from_logits(logits, token)[0]
    drawn = scores_from_logits(
        logits, token, temperature=sampling.temperature, kept_min_logit=kept_min
    )[0]
    return Choice(token, raw, drawn, kept_min)


def sample(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """One token id from one row's ``logits`` (``[vocab]``) with ``key``.

    >>> int(sample(jnp.array([0.0, 3.0, 1.0]), row_key(0, 0, 0), Sampling()))
    1
    """
    return choose(logits, key, sampling).token
