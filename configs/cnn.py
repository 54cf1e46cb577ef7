"""A tiny CNN on synthetic bar-orientation images, FSDP(4) x TensorParallel(2)."""

import ml_collections

from nnx_spmd_trainer.configs import _base


def get_config() -> ml_collections.ConfigDict:
    config = _base.training_config()
    config.model = "cnn"
    config.strategy = "fsdp=-1,model=2"  # fsdp=4,model=2 on 8 devices; fits 1, 2, 4 too
    config.max_steps = 200
    config.batch_size = 64
    config.cnn = ml_collections.ConfigDict()
    config.cnn.image_size = 16
    config.cnn.channels = 16  # output channels split over the model axis
    config.cnn.num_classes = 4
    return config
