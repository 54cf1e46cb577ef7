"""Model blocks any model may use: ``attention`` (causal, sequence-parallel aware),
``ring_attention`` (``ring_blocks``: one block of its ring), ``moe`` (experts), ``stack``
(stacked layers, scanned or pipelined), ``remat`` (activation checkpointing policies),
``losses`` (chunked cross-entropy), ``logprob`` (the one per-token log-probability,
``token_log_probs``: the head's projection and log-softmax a chunk of positions at a time).

They import no engine and no planner: a model written with them runs in a plain
``jax.jit`` loop as well as through the ``Trainer``.
"""

from nnx_spmd_trainer.nn.logprob import token_log_probs

__all__ = ["token_log_probs"]
