"""The default GPT job under DataParallel(8): state replicated, batch split 8 ways."""

import ml_collections

from nnx_spmd_trainer.configs import default


def get_config() -> ml_collections.ConfigDict:
    config = default.get_config()
    config.strategy = "data=8"
    return config
