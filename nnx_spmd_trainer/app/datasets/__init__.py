"""Example data as Grain input pipelines: pydoc text (BPE tokens packed, or characters) and
corpora for the GPT, synthetic tasks for MLP and CNN."""

from nnx_spmd_trainer.app.datasets import corpora, documents, from_config
from nnx_spmd_trainer.app.datasets.base import Splits, index_batches
from nnx_spmd_trainer.app.datasets.synthetic import classification_splits, image_splits
from nnx_spmd_trainer.app.datasets.text import (
    CharTokenizer,
    GPT2ByteTokenizer,
    SplitOptions,
    byte_lm_splits,
    char_lm_splits,
    eval_batches,
    load_text,
    split_tokens,
    train_batches,
    unigram_baseline,
)

__all__ = [
    "CharTokenizer",
    "GPT2ByteTokenizer",
    "SplitOptions",
    "Splits",
    "byte_lm_splits",
    "char_lm_splits",
    "classification_splits",
    "corpora",
    "documents",
    "from_config",
    "eval_batches",
    "image_splits",
    "index_batches",
    "load_text",
    "split_tokens",
    "train_batches",
    "unigram_baseline",
]
