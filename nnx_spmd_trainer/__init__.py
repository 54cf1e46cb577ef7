"""nnx_spmd_trainer: distributed training of Flax NNX models by swapping one strategy object."""

import importlib.metadata

from nnx_spmd_trainer import auto, distributed, moe, remat, stack, weights
from nnx_spmd_trainer.auto import Auto, Choice, LayoutNotChosen, NoLayoutFits
from nnx_spmd_trainer.batch_errors import BatchMismatch
from nnx_spmd_trainer.callback import HOOKS, Callback, CallbackList, History, Logs
from nnx_spmd_trainer.data_shard import DataShard
from nnx_spmd_trainer.export import export_params
from nnx_spmd_trainer.losses import chunked_cross_entropy
from nnx_spmd_trainer.pipeline import grain_pipeline
from nnx_spmd_trainer.plan import Plan
from nnx_spmd_trainer.prefetch import as_position
from nnx_spmd_trainer.run_lock import DirectoryInUse, RunLock
from nnx_spmd_trainer.run_state import Progress, RunState
from nnx_spmd_trainer.sharding import ShardingError, path_str
from nnx_spmd_trainer.state import sharding_table
from nnx_spmd_trainer.step import masked_mean
from nnx_spmd_trainer.strategies import (
    FSDP,
    AxisStrategy,
    DataParallel,
    ExpertParallel,
    Hybrid,
    PipelineParallel,
    SequenceParallel,
    Strategy,
    TensorParallel,
)
from nnx_spmd_trainer.strategies.axis_types import ExplicitModeError
from nnx_spmd_trainer.trainer import Trainer

try:
    __version__ = importlib.metadata.version("nnx-spmd-trainer")
except importlib.metadata.PackageNotFoundError:  # a source tree that is not installed
    __version__ = "0+unknown"

__all__ = [
    "FSDP",
    "Auto",
    "BatchMismatch",
    "Choice",
    "LayoutNotChosen",
    "NoLayoutFits",
    "Callback",
    "CallbackList",
    "DataParallel",
    "DirectoryInUse",
    "ExpertParallel",
    "ExplicitModeError",
    "History",
    "Logs",
    "Plan",
    "Progress",
    "RunLock",
    "RunState",
    "Hybrid",
    "PipelineParallel",
    "SequenceParallel",
    "ShardingError",
    "Strategy",
    "TensorParallel",
    "Trainer",
    "AxisStrategy",
    "DataShard",
    "HOOKS",
    "as_position",
    "auto",
    "chunked_cross_entropy",
    "distributed",
    "export_params",
    "grain_pipeline",
    "masked_mean",
    "moe",
    "path_str",
    "remat",
    "sharding_table",
    "stack",
    "weights",
]
