"""The default run: a small GPT learning ``pydoc_data.topics`` as BPE tokens, packed.

One topic a document; a byte-level BPE of 1024 ids trained on the topics (about a
second, the same merges every time; saved as ``<workdir>/tokenizer.json`` and reused
on resume); documents packed into rows of 64 tokens with segment ids and positions.
The held-out loss is reported in bits per byte too, beside the unigram baseline's.
Hybrid FSDP(4) x TensorParallel(2) on 8 devices; a few minutes on 2 CPU cores
with 8 simulated devices, ending well below the unigram baseline.
``configs/char.py`` is the same model on the text's characters.
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
    config.gpt.vocab_size = 0  # 0: the tokenizer's ids (padded to a multiple of 8)
    config.gpt.dropout_rate = 0.0
    # The layers as one stacked block run by nnx.scan: compiles once, not per layer
    config.gpt.scan_layers = False
    config.gpt.remat = "none"  # per-block activation checkpointing: a remat.POLICIES name
    # Sequence positions per chunk of the loss; 0: the plain loss over the full logits;
    # -1: chunks of 128 where vocabulary x positions >= 2**22 (app.tasks.CHUNKED_FROM)
    config.gpt.chunked_loss = -1
    # Mixture of experts: every moe_every-th block routes each token to moe_top_k of
    # moe_experts expert MLPs (moe.MoE); 0: dense blocks. Split them with expert=N.
    config.gpt.moe_experts = 0
    config.gpt.moe_top_k = 2
    config.gpt.moe_every = 1
    # Each expert takes this many times its even share of tokens, the rest dropped; 0:
    # dropless (every token routed, moe.MoE(capacity_factor=None)).
    config.gpt.moe_capacity_factor = 1.25
    config.eval_fraction = 0.1  # the end of the text (or each corpus's last documents) held out
    config.data = data_config()
    return config


def data_config() -> ml_collections.ConfigDict:
    """``config.data``: what the GPT reads (``app/datasets/from_config.py``)."""
    data = ml_collections.ConfigDict()
    # "": a byte-level BPE trained on the text (a corpus: the corpus's own tokenizer.json);
    # "char": one id a character; else the path of a tokenizer.json (or of its folder)
    data.tokenizer = ""
    data.vocab_size = 1024  # of the BPE trained when data.tokenizer is ""
    # Corpus folders written by `nnx-spmd-train corpus`: "DIR" or "name=DIR,name=DIR";
    # "": the pydoc topics, one a document
    data.corpus = ""
    data.weights = ""  # the corpora's mixture, "name=weight,..." ("": equal)
    data.stages = ""  # weights from given steps on: "1000:a=1,b=3;5000:a=1,b=1"
    data.packed = True  # documents packed into rows; False: one document's piece a row
    data.seq_len = 0  # tokens a row; 0: the model's positions (config.gpt.seq_len)
    data.verify = False  # every chunk's checksum checked first (reads the whole corpus)
    # Chat data (docs/topics/chat.md): a JSONL of {"messages": [...]} rows, the loss on the
    # assistant's tokens; rendered with data.tokenizer's chat template, or the library's
    # ChatML (data.chat_template="chatml"); a conversation longer than a row is "cut" at a
    # turn or "drop"ped (data.chat_too_long)
    data.chat = ""
    data.chat_template = ""
    data.chat_too_long = "cut"
    return data
