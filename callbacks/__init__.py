"""Concrete callbacks for ``nnx_spmd_trainer.Trainer``: the plug-in layer.

From the core these import the names of ``nnx_spmd_trainer.__all__`` and
``nnx_spmd_trainer.data.__all__``, so a user-written callback can do anything these
do. Among them, for checkpoints: ``path_str`` (a state leaf's name), ``as_position``
(a data position for Grain's checkpoint handler), ``RunState.array_stand_ins`` (the
arrays in a saved callback state), ``RunLock`` and ``data.BATCHES_TAKEN``; for the
progress bar, ``is_perf_key`` (which logs keys are not metrics). Beyond those they
import ``nnx_spmd_trainer.deprecation`` (``OrbaxCheckpoint``'s renamed ``report`` warns
through it), ``nnx_spmd_trainer.adapters`` (Orbax's insides, fenced in one module) and
``nnx_spmd_trainer.distributed``. The import-linter contract
``callbacks-public-names-only`` (pyproject.toml) holds them to this.
"""

import importlib
from types import ModuleType

from nnx_spmd_trainer import Callback, History, deprecation

from .checkpoint import (
    CheckpointOfAnotherModel,
    CheckpointWeights,
    CheckpointWriteError,
    DamagedCheckpoint,
    MergedLoRAWeights,
    OrbaxCheckpoint,
)
from .csv_logger import CSVLogger
from .early_stopping import EarlyStopping
from .eval_harness import EvalHarnessCallback
from .lambda_callback import LambdaCallback
from .lr_monitor import LearningRateMonitor
from .metrics import MetricsLogger
from .mlflow_logger import MLflowLogger
from .nan import TerminateOnNaN
from .profiler import Profiler
from .progress import ProgressBar
from .sample import SampleCallback
from .tensorboard import TensorBoard
from .wandb_logger import WandbLogger

__all__ = [
    "CSVLogger",
    "CheckpointOfAnotherModel",
    "CheckpointWeights",
    "CheckpointWriteError",
    "DamagedCheckpoint",
    "Callback",
    "EarlyStopping",
    "EvalHarnessCallback",
    "History",
    "LambdaCallback",
    "LearningRateMonitor",
    "MLflowLogger",
    "MergedLoRAWeights",
    "MetricsLogger",
    "OrbaxCheckpoint",
    "Profiler",
    "ProgressBar",
    "SampleCallback",
    "TensorBoard",
    "TerminateOnNaN",
    "WandbLogger",
]


def __getattr__(name: str) -> ModuleType:
    """``callbacks.checkpoint_save`` and the other modules that moved into
    ``callbacks/checkpoint/`` still answer as attributes (the import warns once, through
    ``deprecation.MOVED_MODULES``)."""
    if f"callbacks.{name}" in deprecation.MOVED_MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
