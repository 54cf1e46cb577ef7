"""GPT-2 small shapes (124M parameters) on the pydoc text, in bf16: the GPU benchmark job.

12 layers x 768, 12 heads, 3072 feed-forward, 1024 tokens, the vocabulary padded
to GPT-2's 50304 rows (the characters of the text use the first ~100). bf16
compute with fp32 master weights; cuDNN attention on a GPU. Data parallel over
every device. Far too big for a CPU beyond a step or two.
"""

import ml_collections

from nnx_spmd_trainer.configs import _base


def get_config() -> ml_collections.ConfigDict:
    config = _base.training_config()
    config.model = "gpt"
    config.strategy = "data=-1"
    config.num_devices = 1
    config.compute_dtype = "bfloat16"
    config.batch_size = 16
    config.learning_rate = 6e-4
    config.warmup_steps = 50
    config.max_steps = 300
    config.gpt = ml_collections.ConfigDict()
    config.gpt.seq_len = 1024
    config.gpt.embed_dim = 768
    config.gpt.num_heads = 12
    config.gpt.ff_dim = 3072
    config.gpt.num_layers = 12
    config.gpt.vocab_size = 50304
    config.gpt.dropout_rate = 0.0
    # Off: the GPU benchmark's measured job (gpt2_medium.py and gpt2_large.py turn them on)
    config.gpt.scan_layers = False
    config.gpt.remat = "none"
    config.gpt.chunked_loss = 0
    config.eval_fraction = 0.1
    return config
