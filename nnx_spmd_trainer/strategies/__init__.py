"""Strategies: small immutable objects answering the layout questions."""

from nnx_spmd_trainer.strategies.axis import AxisStrategy
from nnx_spmd_trainer.strategies.base import Strategy
from nnx_spmd_trainer.strategies.data_parallel import DataParallel
from nnx_spmd_trainer.strategies.expert import ExpertParallel
from nnx_spmd_trainer.strategies.fsdp import FSDP
from nnx_spmd_trainer.strategies.hybrid import Hybrid
from nnx_spmd_trainer.strategies.pipeline import PipelineParallel
from nnx_spmd_trainer.strategies.sequence import SequenceParallel
from nnx_spmd_trainer.strategies.tensor_parallel import TensorParallel

__all__ = [
    "AxisStrategy",
    "DataParallel",
    "ExpertParallel",
    "FSDP",
    "Hybrid",
    "PipelineParallel",
    "SequenceParallel",
    "Strategy",
    "TensorParallel",
]
