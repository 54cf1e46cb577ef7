"""nnx_spmd_trainer: distributed training of Flax NNX models by swapping one strategy object."""

from nnx_spmd_trainer.callback import Callback, CallbackList, History, Logs
from nnx_spmd_trainer.sharding import ShardingError
from nnx_spmd_trainer.strategies import FSDP, DataParallel, Hybrid, Strategy, TensorParallel
from nnx_spmd_trainer.trainer import Trainer

__all__ = [
    "FSDP",
    "Callback",
    "CallbackList",
    "DataParallel",
    "History",
    "Logs",
    "Hybrid",
    "ShardingError",
    "Strategy",
    "TensorParallel",
    "Trainer",
]
