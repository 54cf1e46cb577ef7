"""nnx_spmd_trainer: distributed training of Flax NNX models by swapping one strategy object."""

import importlib.metadata
from typing import Any

from nnx_spmd_trainer import deprecation, distributed, weights
from nnx_spmd_trainer.callback import HOOKS, Callback, CallbackList, History, Logs
from nnx_spmd_trainer.data.batch_errors import BatchMismatch
from nnx_spmd_trainer.data.grain_input import grain_pipeline
from nnx_spmd_trainer.data.position import as_position
from nnx_spmd_trainer.data_shard import DataShard
from nnx_spmd_trainer.engine.metric_log import LogSchedule, is_perf_key
from nnx_spmd_trainer.engine.run_state import Progress, RunState
from nnx_spmd_trainer.engine.step_record import StepRecord
from nnx_spmd_trainer.generate import Generation, Sampler, Sampling
from nnx_spmd_trainer.io.export import export_params
from nnx_spmd_trainer.io.run_lock import DirectoryInUse, RunLock
from nnx_spmd_trainer.nn import lora, moe, remat, stack
from nnx_spmd_trainer.nn.logprob import token_log_probs
from nnx_spmd_trainer.nn.logprob_model import OutputHead
from nnx_spmd_trainer.nn.lora import LoRA
from nnx_spmd_trainer.nn.losses import chunked_cross_entropy
from nnx_spmd_trainer.optim.ema import EMA
from nnx_spmd_trainer.optim.spikes import SpikeSkip
from nnx_spmd_trainer.planner import auto, compile_cache, saved_step, target_choice
from nnx_spmd_trainer.planner.auto import Auto, Choice, LayoutNotChosen, NoLayoutFits
from nnx_spmd_trainer.planner.flops import peak_flops
from nnx_spmd_trainer.planner.plan import Plan
from nnx_spmd_trainer.planner.plan_report import PlanReport
from nnx_spmd_trainer.planner.state import sharding_table
from nnx_spmd_trainer.planner.step import TOKEN_WEIGHT, batch_mask, masked_mean
from nnx_spmd_trainer.planner.target import Target
from nnx_spmd_trainer.sharding import ShardingError, path_str
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

deprecation.redirect_moved_modules(__name__)  # nnx_spmd_trainer.moe and the other 0.1 paths

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
    "EMA",
    "ExpertParallel",
    "ExplicitModeError",
    "History",
    "Logs",
    "LogSchedule",
    "LoRA",
    "OutputHead",
    "Plan",
    "PlanReport",
    "Progress",
    "Generation",
    "Sampler",
    "Sampling",
    "RunLock",
    "RunState",
    "StepRecord",
    "Target",
    "Hybrid",
    "PipelineParallel",
    "SequenceParallel",
    "ShardingError",
    "SpikeSkip",
    "Strategy",
    "TensorParallel",
    "Trainer",
    "AxisStrategy",
    "DataShard",
    "HOOKS",
    "TOKEN_WEIGHT",
    "as_position",
    "is_perf_key",
    "lora",
    "auto",
    "batch_mask",
    "chunked_cross_entropy",
    "compile_cache",
    "distributed",
    "export_params",
    "grain_pipeline",
    "masked_mean",
    "moe",
    "path_str",
    "peak_flops",
    "remat",
    "saved_step",
    "sharding_table",
    "stack",
    "target_choice",
    "token_log_probs",
    "weights",
]


def __getattr__(name: str) -> Any:
    # HarnessLM subclasses lm_eval's LM: imported when asked for, so the package needs
    # lm-eval (the [lm-eval] extra) only where it is used.
    if name == "HarnessLM":
        from nnx_spmd_trainer.generate.harness import HarnessLM

        return HarnessLM
    raise AttributeError(f"module 'nnx_spmd_trainer' has no attribute {name!r}")
