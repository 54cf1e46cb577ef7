"""Pretrained weights in and out: other people's files read straight into a plan's layout.

A ``WeightMap`` says how each model array is made from a file's tensors
(``tensor``, ``transpose``, ``reshape``, ``split``, ``concat``, ``stack``,
``take``, ``pad``, ``cast``); ``load_weights`` reads a source (``SafetensorsSource``,
``TreeSource``, ``OrbaxSource``) through it, each device given only its own
blocks; ``save_safetensors`` reads the map backwards and writes the file again.

>>> import numpy as np
>>> m = WeightMap({"wte/embedding": pad(tensor("wte.weight", (5, 2)), axis=0, size=8)})
>>> m.targets["wte/embedding"].shape
(8, 2)
"""

from nnx_spmd_trainer.weights.expr import Expr, Piece, Tensor, Tensors, tensor
from nnx_spmd_trainer.weights.load import (
    Pretrained,
    load_weights,
    param_targets,
    pretrained_state,
)
from nnx_spmd_trainer.weights.mapping import WeightMap, WeightsMismatch, check
from nnx_spmd_trainer.weights.save import save_safetensors
from nnx_spmd_trainer.weights.sources import (
    OrbaxSource,
    SafetensorsSource,
    TensorInfo,
    TreeSource,
    WeightSource,
)
from nnx_spmd_trainer.weights.transforms import (
    cast,
    concat,
    pad,
    reshape,
    split,
    stack,
    take,
    transpose,
)

__all__ = [
    "Expr",
    "OrbaxSource",
    "Piece",
    "Pretrained",
    "SafetensorsSource",
    "Tensor",
    "Tensors",
    "TensorInfo",
    "TreeSource",
    "WeightMap",
    "WeightSource",
    "WeightsMismatch",
    "cast",
    "check",
    "concat",
    "load_weights",
    "pad",
    "param_targets",
    "pretrained_state",
    "reshape",
    "save_safetensors",
    "split",
    "stack",
    "take",
    "tensor",
    "transpose",
]
