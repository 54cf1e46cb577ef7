"""The seeds' MLP on a synthetic classification task, DataParallel(4) x TensorParallel(2)."""

import ml_collections

from nnx_spmd_trainer.configs import _base


def get_config() -> ml_collections.ConfigDict:
    config = _base.training_config()
    config.model = "mlp"
    config.strategy = "data=4,model=2"
    config.max_steps = 300
    config.batch_size = 64
    config.mlp = ml_collections.ConfigDict()
    config.mlp.num_features = 32
    config.mlp.hidden_dim = 256  # split over the model axis
    config.mlp.num_classes = 8
    config.mlp.dropout_rate = 0.0
    return config
