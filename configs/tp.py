"""The default GPT job under TensorParallel(8): heads, ff and vocabulary split 8 ways."""

import ml_collections

from nnx_spmd_trainer.configs import default


def get_config() -> ml_collections.ConfigDict:
    config = default.get_config()
    config.strategy = "model=8"
    return config
