"""Hugging Face's GPT-2 small fine-tuned on the pydoc text: ``--config.init_from=FILE``.

The model is ``app/models/gpt2_hf.GPT2`` (HF's ``GPT2LMHeadModel`` computed exactly:
12 layers x 768, 12 heads, 1024 positions, the 50257-token vocabulary padded to a
multiple of 64 so a ``model`` axis divides it). With
``--config.init_from=gpt2/model.safetensors`` (HF's file, downloaded by you; its
``GPT2Model`` or ``GPT2LMHeadModel`` names both work) the first state is read from
it through ``gpt2_weight_map``; without, the model starts random. A run that
resumes from its own checkpoints restores those and never reads the file.

Tokens: GPT-2's byte-level tokens without its merges. Each UTF-8 byte of the text
is the id GPT-2's vocabulary gives that byte alone, the byte's place in its
byte-to-unicode table (``datasets.text.gpt2_byte_ranks``: space is 220, newline 198),
so the pretrained embeddings see text they know, spelled one byte a token. This
is not GPT-2's BPE: its merges (``merges.txt``) are not shipped, so the text is
longer in tokens than GPT-2 would make it, and the held-out loss is nats per byte,
compared with the unigram baseline over the 256 byte tokens.

float32 compute (the model has no bf16 path); too big for a CPU beyond a step or two.
"""

import ml_collections

from nnx_spmd_trainer.configs import _base


def get_config() -> ml_collections.ConfigDict:
    config = _base.training_config()
    config.model = "gpt2_hf"
    config.strategy = "fsdp=-1,model=2"
    config.num_devices = 1
    config.batch_size = 8
    config.learning_rate = 1e-4  # fine-tuning: far below training from scratch
    config.warmup_steps = 20
    config.max_steps = 200
    config.gpt2_hf = ml_collections.ConfigDict()
    config.gpt2_hf.seq_len = 1024
    config.gpt2_hf.vocab_size = 50257
    config.gpt2_hf.pad_vocab_to = 64
    config.gpt2_hf.n_positions = 1024
    config.gpt2_hf.n_embd = 768
    config.gpt2_hf.n_layer = 12
    config.gpt2_hf.n_head = 12
    config.gpt2_hf.dropout = 0.1
    config.gpt2_hf.scan_layers = False
    config.eval_fraction = 0.1
    return config
