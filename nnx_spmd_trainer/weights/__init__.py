"""Pretrained weights in and out: other people's files read straight into a plan's layout.

A ``WeightMap`` says how each model array is made from a file's tensors
(``tensor``, ``transpose``, ``reshape``, ``split``, ``concat``, ``stack``,
``take``, ``pad``, ``cast``); ``load_weights`` reads a source (``SafetensorsSource``,
``TreeSource``, ``OrbaxSource``) through it, each device given only its own
blocks; ``save_safetensors`` reads the map backwards and writes the file again. LoRA adapters go
out through the same map: ``peft_adapter``/``write_peft_adapter`` as a PEFT adapter
directory (``peft.py``; ``load_peft_adapter`` reads one into a model in one call),
``merged_params`` folded into the base (``merge.py``). ``written_whole``: an export
directory written beside its name and renamed once whole (a full disk leaves nothing);
``check_export_path``: the refusal of an occupied export path, before anything is written.

>>> import numpy as np
>>> m = WeightMap({"wte/embedding": pad(tensor("wte.weight", (5, 2)), axis=0, size=8)})
>>> m.targets["wte/embedding"].shape
(8, 2)
"""

from nnx_spmd_trainer.data.written import check_export_path, written_whole
from nnx_spmd_trainer.weights.expr import Expr, Piece, Tensor, Tensors, tensor
from nnx_spmd_trainer.weights.load import (
    Pretrained,
    load_weights,
    param_targets,
    pretrained_state,
)
from nnx_spmd_trainer.weights.mapping import WeightMap, WeightsMismatch, check
from nnx_spmd_trainer.weights.merge import lora_pairs, merged_params
from nnx_spmd_trainer.weights.peft import (
    PeftAdapter,
    adapter_arrays,
    peft_adapter,
    read_peft_adapter,
    write_peft_adapter,
)
from nnx_spmd_trainer.weights.peft_load import load_peft_adapter
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
    "PeftAdapter",
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
    "adapter_arrays",
    "cast",
    "check",
    "check_export_path",
    "concat",
    "load_peft_adapter",
    "load_weights",
    "lora_pairs",
    "merged_params",
    "pad",
    "param_targets",
    "peft_adapter",
    "pretrained_state",
    "read_peft_adapter",
    "reshape",
    "save_safetensors",
    "split",
    "stack",
    "take",
    "tensor",
    "transpose",
    "write_peft_adapter",
    "written_whole",
]
