"""The default job's GPT on the characters of ``pydoc_data.topics``: the character job.

One id a character of the text (about 100, padded to a multiple of 8), windows of
64 characters at random offsets: the default job before it read BPE tokens. Its
held-out loss in bits per byte (a character's UTF-8 bytes) compares with the
default job's (README, "Bits per byte").
"""

import ml_collections

from nnx_spmd_trainer.configs import default


def get_config() -> ml_collections.ConfigDict:
    config = default.get_config()
    config.data.tokenizer = "char"  # the other config.data keys are for tokens
    return config
