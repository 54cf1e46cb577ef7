"""Choosing the next token: pure functions of float32 logits and a key.

Each row draws from its own key, ``row_key(seed, step, row)``: ``jax.random.fold_in``
of the seed by the decode step and the prompt's index. No random op ever runs over
a sharded array, so the same seed gives the same tokens however the rows are laid
out: under any strategy, on one device or eight.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

__all__ = ["Sampling", "log_probabilities", "row_key", "sample"]


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


def log_probabilities(logits: jax.Array) -> jax.Array:
    """``log_softmax`` of the raw logits in float32: what a sampled token's
    log-probability is read from (never the tempered or truncated distribution)."""
    return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


def row_key(seed: jax.Array | int, step: jax.Array | int, row: jax.Array | int) -> jax.Array:
    """The key of one row at one decode step: the same for a prompt wherever it sits.

    >>> bool((row_key(0, 1, 2) == row_key(0, 1, 2)).all())
    True
    """
    key = jax.random.fold_in(jax.random.key(seed), step)
    return jax.random.fold_in(key, row)


def _truncated(logits: jax.Array, sampling: Sampling) -> jax.Array:
    """``logits`` (one row, float32) with the tokens outside top-k and top-p at -inf."""
    low = jnp.finfo(jnp.float32).min
    if sampling.top_k and sampling.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, sampling.top_k)[0][-1]
        logits = jnp.where(logits < kth, low, logits)
    if sampling.top_p < 1.0:
        order = jnp.argsort(-logits)
        probabilities = jax.nn.softmax(logits[order])
        before = jnp.cumsum(probabilities) - probabilities  # mass of the tokens ranked above
        keep_sorted = before < sampling.top_p  # the first token is always kept
        keep = jnp.zeros_like(keep_sorted).at[order].set(keep_sorted)
        logits = jnp.where(keep, logits, low)
    return logits


def sample(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """One token id from one row's ``logits`` (``[vocab]``) with ``key``.

    >>> int(sample(jnp.array([0.0, 3.0, 1.0]), row_key(0, 0, 0), Sampling()))
    1
    """
    logits = logits.astype(jnp.float32)
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = _truncated(logits / sampling.temperature, sampling)
    return jax.random.categorical(key, scaled).astype(jnp.int32)
