"""The default GPT job under FSDP(8): parameters, gradients, optimizer state split 8 ways."""

import ml_collections

from nnx_spmd_trainer.configs import default


def get_config() -> ml_collections.ConfigDict:
    config = default.get_config()
    config.strategy = "fsdp=8"
    return config
