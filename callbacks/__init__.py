"""Concrete callbacks for ``nnx_spmd_trainer.Trainer``: the plug-in layer.

Everything here uses the core's public API only; a user-written callback can
do anything these do.
"""

from nnx_spmd_trainer import Callback, History

from .checkpoint import DamagedCheckpoint, OrbaxCheckpoint
from .checkpoint_save import CheckpointWriteError
from .csv_logger import CSVLogger
from .early_stopping import EarlyStopping
from .lambda_callback import LambdaCallback
from .lr_monitor import LearningRateMonitor
from .metrics import MetricsLogger
from .nan import TerminateOnNaN
from .profiler import Profiler
from .progress import ProgressBar
from .tensorboard import TensorBoard

__all__ = [
    "CSVLogger",
    "CheckpointWriteError",
    "DamagedCheckpoint",
    "Callback",
    "EarlyStopping",
    "History",
    "LambdaCallback",
    "LearningRateMonitor",
    "MetricsLogger",
    "OrbaxCheckpoint",
    "Profiler",
    "ProgressBar",
    "TensorBoard",
    "TerminateOnNaN",
]
