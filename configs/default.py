"""The default run: a small character-level GPT learning ``pydoc_data.topics``.

Hybrid FSDP(4) x TensorParallel(2) on 8 devices; a few minutes on 2 CPU cores
with 8 simulated devices, ending well below the unigram baseline.
"""

import ml_collections

from nnx_spmd_trainer.configs import _base


def get_config() -> ml_collections.ConfigDict:
    config = _base.training_config()
    config.model = "gpt"
    config.strategy = "fsdp=-1,model=2"  # fsdp=4,model=2 on 8 devices; fits 1, 2, 4 too
    config.gpt = ml_collections.ConfigDict()
    config.gpt.seq_len = 64
    config.gpt.embed_dim = 128
    config.gpt.num_heads = 8  # split over the model axis: divisible by 2, 4 and 8
    config.gpt.ff_dim = 512
    config.gpt.num_layers = 2
    config.gpt.vocab_size = 0  # 0: the text's characters (padded to a multiple of 8)
    config.gpt.dropout_rate = 0.0
    # The layers as one stacked block run by nnx.scan: compiles once, not per layer
    config.gpt.scan_layers = False
    config.gpt.remat = "none"  # per-block activation checkpointing: a remat.POLICIES name
    # Sequence positions per chunk of the loss; 0: the plain loss over the full logits
    config.gpt.chunked_loss = 0
    # Mixture of experts: every moe_every-th block routes each token to moe_top_k of
    # moe_experts expert MLPs (moe.MoE); 0: dense blocks. Split them with expert=N.
    config.gpt.moe_experts = 0
    config.gpt.moe_top_k = 2
    config.gpt.moe_every = 1
    config.eval_fraction = 0.1  # the end of the text is held out
    return config
