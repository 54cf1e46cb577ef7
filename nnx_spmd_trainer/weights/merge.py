"""LoRA adapters found in a model (``nnx.LoRA`` layers), and the model with them folded into
its base: what ``--export_format=peft`` and ``--export_format=merged`` write.

An ``nnx.LoRA`` layer holds its base layer (``base_module``) and ``lora_a`` ``[in, r]``,
``lora_b`` ``[r, out]`` (``[layers, ...]`` when stacked); its output is
``base(x) + scale * x @ lora_a @ lora_b``. The merged model is the plain one: each such
layer's kernel ``W + scale * lora_a @ lora_b`` under the base's own path, which the
base's ``WeightMap`` writes (``save_safetensors``) and the plain model loads.

>>> import jax.numpy as jnp
>>> from flax import nnx
>>> lora = nnx.LoRA(3, 2, 4, base_module=nnx.Linear(3, 4, rngs=nnx.Rngs(0)), rngs=nnx.Rngs(0))
>>> sorted(lora_pairs(lora)), sorted(merged_params(lora))
(['kernel'], ['bias', 'kernel'])
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_spmd_trainer.sharding import path_str

__all__ = ["lora_pairs", "merged_params"]

_BASE = "base_module"


def _lora_layers(model: nnx.Module) -> dict[tuple[Any, ...], nnx.LoRA]:
    return {
        tuple(path): node
        for path, node in nnx.iter_graph(model)
        if isinstance(node, nnx.LoRA) and isinstance(getattr(node, _BASE, None), nnx.Module)
    }


def lora_pairs(model: nnx.Module) -> dict[str, tuple[jax.Array, jax.Array]]:
    """``{the base kernel's path in the plain model: (lora_a, lora_b)}`` of every
    ``nnx.LoRA`` layer of ``model`` (``"h/0/attn/q/kernel"``: the path the base's
    ``WeightMap`` names, ``base_module`` left out): ``weights.peft.peft_adapter``'s input."""
    return {
        path_str((*path, "kernel")): (layer.lora_a[...], layer.lora_b[...])
        for path, layer in _lora_layers(model).items()
    }


def merged_params(model: nnx.Module, *, scale: float = 1.0) -> dict[str, jax.Array]:
    """The plain model's parameters, flat by path: every ``nnx.Param`` but the adapters,
    each ``nnx.LoRA`` layer's base under the layer's own path, its kernel
    ``W + scale * lora_a @ lora_b`` (in float32, cast back to the kernel's dtype).
    ``scale``: what the adapters' product is multiplied by in the forward pass (1 for
    Flax's ``nnx.LoRA``). ``weights.save_safetensors`` writes it through the base's map."""
    layers = _lora_layers(model)
    frozen = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))
    out: dict[str, jax.Array] = {}
    for path, variable in nnx.to_flat_state(nnx.state(model, frozen)):
        path = tuple(path)
        value = variable.get_value()
        owner = path[:-2] if len(path) >= 2 and path[-2] == _BASE else None
        if owner is not None and owner in layers:
            path = (*owner, path[-1])
            if path[-1] == "kernel":
                layer = layers[owner]
                delta = jnp.matmul(layer.lora_a[...], layer.lora_b[...]).astype(jnp.float32)
                value = (value.astype(jnp.float32) + scale * delta).astype(value.dtype)
        out[path_str(path)] = value
    return out
