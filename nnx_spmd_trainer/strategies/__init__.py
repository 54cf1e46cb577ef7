"""Strategies: small immutable objects answering the layout questions.

- ``base.py``: ``Strategy``, the six questions and their default answers
- ``axis.py``: ``AxisStrategy``, the base of the single-axis strategies
- ``data_parallel.py``: ``DataParallel``, the state replicated, the batch split
- ``fsdp.py``: ``FSDP``, parameters, gradients and optimizer state sharded
- ``tensor_parallel.py``: ``TensorParallel``, layers sharded along their annotations
- ``sequence.py``: ``SequenceParallel``, the batch's sequence dimension split
- ``pipeline.py``: ``PipelineParallel``, a stack's layers split over a stage axis
- ``expert.py``: ``ExpertParallel``, the experts of mixture-of-experts layers split
- ``hybrid.py``: ``Hybrid``, strategies composed as ``optax.chain`` composes
- ``axis_types.py``: the mesh's axis types, ``"auto"`` or ``"explicit"``
- ``host_axes.py``: which mesh axes span hosts (per-layer ones inside a host, ``across_hosts``)
"""

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
