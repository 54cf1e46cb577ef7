"""Sampling from a trained model on its training mesh: ``Sampler`` (prefill, decode
with a key-value cache, stops), the sampling functions (``Sampling``, ``sample``,
``row_key``), and the compiled programs (``DecodePrograms``)."""

from nnx_spmd_trainer.generate.programs import DecodePrograms
from nnx_spmd_trainer.generate.sampler import (
    CacheTooLarge,
    DecodeTiming,
    Generation,
    Sampler,
    TextCodec,
)
from nnx_spmd_trainer.generate.sampling import Sampling, log_probabilities, row_key, sample

__all__ = [
    "CacheTooLarge",
    "DecodePrograms",
    "DecodeTiming",
    "Generation",
    "Sampler",
    "Sampling",
    "TextCodec",
    "log_probabilities",
    "row_key",
    "sample",
]
