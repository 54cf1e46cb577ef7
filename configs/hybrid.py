"""The default GPT job on a 3-D mesh: DataParallel(2) x FSDP(2) x TensorParallel(2)."""

import ml_collections

from nnx_spmd_trainer.configs import default


def get_config() -> ml_collections.ConfigDict:
    config = default.get_config()
    config.strategy = "data=2,fsdp=2,model=2"
    return config
