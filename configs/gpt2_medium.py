"""GPT-2 medium shapes (~355M parameters as GPT-2 counts them) on the pydoc text, bf16, for GPUs.

24 layers x 1024, 16 heads, 4096 feed-forward, 1024 tokens, the vocabulary padded
to 50304 rows. The head is not tied to the token embedding, which adds 51M
parameters (406M in all). bf16 compute with fp32 master weights; cuDNN attention
on a GPU; data parallel over every device (parameters and AdamW moments, ~5 GB in
fp32, fit one GPU).

The defaults a GPU wants at this depth, unlike ``gpt2_small`` (the benchmark job):

- ``scan_layers``: the 24 blocks are one stacked block run by ``nnx.scan``, so the
  step is traced and compiled for one layer, not 24 (``benchmarks/compile_depth.py``).
- ``remat="dots_with_no_batch_dims_saveable"``: each block keeps only its
  projections' outputs and recomputes attention and the elementwise work in the
  backward pass, which is cheap next to the matmuls: the activations that grow with
  depth x batch x sequence shrink, leaving room for the batch (``"full"`` keeps
  only each block's input and costs a whole extra forward pass).
- ``chunked_loss=128``: the loss's 16 x 1024 x 50304 fp32 logits (3.3 GB, and as
  much again for their gradient) are computed 128 positions at a time.
"""

import ml_collections

from nnx_spmd_trainer.configs import gpt2_small


def get_config() -> ml_collections.ConfigDict:
    config = gpt2_small.get_config()
    config.learning_rate = 3e-4
    config.warmup_steps = 100
    config.gpt.embed_dim = 1024
    config.gpt.num_heads = 16
    config.gpt.ff_dim = 4096
    config.gpt.num_layers = 24
    config.gpt.scan_layers = True
    config.gpt.remat = "dots_with_no_batch_dims_saveable"
    config.gpt.chunked_loss = 128
    return config
