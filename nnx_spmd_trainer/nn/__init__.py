"""Model blocks any model may use: ``attention`` (causal, sequence-parallel aware),
``ring_attention`` (``ring_blocks``: one block of its ring), ``moe`` (experts), ``stack``
(stacked layers, scanned or pipelined), ``remat`` (activation checkpointing policies),
``losses`` (chunked cross-entropy).

They import no engine and no planner: a model written with them runs in a plain
``jax.jit`` loop as well as through the ``Trainer``.
"""
