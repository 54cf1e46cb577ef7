"""Sampling from a trained model on its training mesh: ``Sampler`` (prefill, then the
decode steps in one loop on the devices, stops), the sampling functions (``Sampling``,
``choose``, ``sample``, ``row_key``), the compiled programs (``DecodePrograms``), and the
conventions a model decodes in (``decoding``: the cache in its attention modules, or
as an argument; ``ContextLength``)."""

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
