"""GPT-2 large shapes (~774M parameters as GPT-2 counts them) on the pydoc text, bf16, for GPUs.

36 layers x 1280, 20 heads, 5120 feed-forward, 1024 tokens, the vocabulary padded
to 50304 rows. The head is not tied to the token embedding, which adds 64M
parameters (838M in all). bf16 compute with fp32 master weights; cuDNN attention
on a GPU. FSDP over every device: the parameters and AdamW moments (~10 GB in
fp32) are split across the GPUs (on one GPU the same as data parallel).

Scanned layers, per-block remat and the chunked loss as in ``gpt2_medium``, for
the same reasons: one layer compiled, not 36; activations cut to the projections'
outputs; the vocabulary-sized logits never whole.
"""

import ml_collections

from nnx_spmd_trainer.configs import gpt2_medium


def get_config() -> ml_collections.ConfigDict:
    config = gpt2_medium.get_config()
    config.strategy = "fsdp=-1"
    config.learning_rate = 2.5e-4
    config.gpt.embed_dim = 1280
    config.gpt.num_heads = 20
    config.gpt.ff_dim = 5120
    config.gpt.num_layers = 36
    return config
