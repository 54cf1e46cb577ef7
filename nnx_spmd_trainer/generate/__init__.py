"""Sampling from a trained model on its training mesh: ``Sampler`` (prefill, then the
decode steps in one loop on the devices, stops), the sampling functions (``Sampling``,
``choose``, ``sample``, ``row_key``), the compiled programs (``DecodePrograms``), and the
conventions a model decodes in (``decoding``: the cache in its attention modules, or
as an argument; ``ContextLength``)."""

from typing import Any

import jax
import jax.numpy as jnp

from nnx_spmd_trainer.deprecation import warn_renamed
from nnx_spmd_trainer.generate.decoding import (
    CacheArgument,
    CacheInModules,
    ContextLength,
    context_length,
)
from nnx_spmd_trainer.generate.memory import DecodeMemory
from nnx_spmd_trainer.generate.programs import Carry, DecodePrograms, Inputs
from nnx_spmd_trainer.generate.sampler import (
    CacheTooLarge,
    DecodeTiming,
    Generation,
    Sampler,
    TextCodec,
)
from nnx_spmd_trainer.generate.sampling import (
    Choice,
    Sampling,
    choose,
    row_key,
    sample,
)

__all__ = [
    "CacheArgument",
    "CacheInModules",
    "CacheTooLarge",
    "Carry",
    "Choice",
    "ContextLength",
    "DecodeMemory",
    "DecodePrograms",
    "DecodeTiming",
    "Generation",
    "Inputs",
    "Sampler",
    "Sampling",
    "TextCodec",
    "choose",
    "context_length",
    "row_key",
    "sample",
]


def __getattr__(name: str) -> Any:
    """``log_probabilities`` (removed in 0.2.0): the raw ``log_softmax`` over the
    vocabulary, which the library no longer writes; ``nn.token_log_probs`` (or
    ``nn.logprob.scores_from_logits`` on logits you hold) reads a token's without it."""
    if name == "log_probabilities":
        warn_renamed(
            "nnx_spmd_trainer.generate.log_probabilities", "nnx_spmd_trainer.nn.token_log_probs"
        )

        def log_probabilities(logits: jax.Array) -> jax.Array:
            return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)

        return log_probabilities
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
