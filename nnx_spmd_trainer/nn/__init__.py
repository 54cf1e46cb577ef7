"""Model blocks any model may use: ``attention`` (causal, sequence-parallel aware),
``ring_attention`` (``ring_blocks``: one block of its ring), ``moe`` (experts), ``stack``
(stacked layers, scanned or pipelined), ``remat`` (activation checkpointing policies),
``losses`` (chunked cross-entropy), ``logprob`` (the one per-token log-probability,
``token_log_probs``: the head's projection and log-softmax a chunk of positions at a time).

They import no engine and no planner: a model written with them runs in a plain
``jax.jit`` loop as well as through the ``Trainer``.

This package's namespace is public: the blocks a model written against the library uses
(the shipped GPTs in ``app/models`` are written with these names only). ``moe``, ``stack``,
``remat`` and ``lora`` are public modules of the facade (``nnx_spmd_trainer.moe``, ...).
"""

from nnx_spmd_trainer.nn.attention import FORMS as ATTENTION_FORMS
from nnx_spmd_trainer.nn.attention import attention_implementation, causal_attention
from nnx_spmd_trainer.nn.kv_cache import MaskedAttention, set_cache_mask, update_cache
from nnx_spmd_trainer.nn.logprob import token_log_probs
from nnx_spmd_trainer.nn.packed import (
    PACKING_FIELDS,
    packed_inputs,
    packing_fields,
    target_weights,
    token_weights,
)

__all__ = [
    "ATTENTION_FORMS",
    "PACKING_FIELDS",
    "MaskedAttention",
    "attention_implementation",
    "causal_attention",
    "packed_inputs",
    "packing_fields",
    "set_cache_mask",
    "target_weights",
    "token_log_probs",
    "token_weights",
    "update_cache",
]
