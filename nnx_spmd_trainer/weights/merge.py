"""LoRA adapters found in a model, and the model with them folded into its base: what
``--export_format=peft`` and ``--export_format=merged`` write.

An adapted layer at path ``X`` holds ``X/lora_a`` ``[in, r]`` and ``X/lora_b`` ``[r, out]``
(``nnx.LoRAParam``; ``[layers, ...]`` when stacked) beside its kernel, at ``X/kernel``
(``nn.lora``'s adapted layers) or ``X/base_module/kernel`` (Flax's ``nnx.LoRA``
wrapper); its output is ``base(x) + scale * x @ lora_a @ lora_b``. Only the adapters'
state is read, so any layer laid out so is found. The merged model is the plain one:
each such kernel ``W + scale * lora_a @ lora_b`` under the base's own path, which the
base's ``WeightMap`` writes (``save_safetensors``) and the plain model loads. The
folding of ``nn.lora``'s layers is ``nn.lora.merge`` (on a copy: any kernel shape, a
stacked or an ``Einsum`` one); only Flax's wrapper is folded here.

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

from nnx_spmd_trainer.nn import lora as nn_lora
from nnx_spmd_trainer.sharding import path_str

__all__ = ["lora_pairs", "merged_params"]

_BASE = "base_module"
_A, _B = "lora_a", "lora_b"


def _flat(model: nnx.Module, which: nnx.filterlib.Filter) -> dict[tuple[Any, ...], jax.Array]:
    return {tuple(p): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, which))}


def _owners(model: nnx.Module) -> dict[tuple[Any, ...], tuple[jax.Array, jax.Array]]:
    """``{adapted layer's path: (lora_a, lora_b)}``."""
    adapters = _flat(model, nnx.LoRAParam)
    return {
        path[:-1]: (value, adapters[(*path[:-1], _B)])
        for path, value in adapters.items()
        if path[-1] == _A and (*path[:-1], _B) in adapters
    }


def lora_pairs(model: nnx.Module) -> dict[str, tuple[jax.Array, jax.Array]]:
    """``{the base kernel's path in the plain model: (lora_a, lora_b)}`` of every adapted
    layer of ``model`` (``"h/0/attn/q/kernel"``: the path the base's ``WeightMap`` names,
    ``base_module`` left out): ``weights.peft.peft_adapter``'s input."""
    return {path_str((*path, "kernel")): pair for path, pair in _owners(model).items()}


def merged_params(model: nnx.Module, *, scale: float | None = None) -> dict[str, jax.Array]:
    """The plain model's parameters, flat by path: every ``nnx.Param`` but the adapters,
    an ``nnx.LoRA`` wrapper's base under the wrapper's own path, each adapted kernel
    ``W + scale * lora_a @ lora_b`` (in float32, cast back to the kernel's dtype).
    Each ``nn.lora`` layer is folded at its own scale (its ``LoRA``'s ``alpha / rank``:
    layers adapted by two ``LoRA`` s keep theirs); ``scale`` is the one of Flax's
    ``nnx.LoRA`` wrappers, which hold none (``None``: 1, their forward pass's). A
    ``scale`` that contradicts an ``nn.lora`` layer's own is a ``ValueError``: the merge
    would not compute what the adapted model did. ``model`` is unchanged: ``nn.lora``'s
    layers are folded by ``nn.lora.merge`` on a copy. ``weights.save_safetensors``
    writes the result through the base's map."""
    plain = nnx.clone(model)  # new Variables over the same arrays: nothing is copied
    for where, layer in nn_lora.adapted_layers(plain).items():
        if scale is not None and float(scale) != float(layer.lora_scale):
            raise ValueError(
                f"merged_params(scale={scale}): {where} holds adapters of scale "
                f"{layer.lora_scale} (its LoRA's alpha / rank), and each nn.lora layer is "
                "folded at its own: leave scale out (it is for Flax's nnx.LoRA wrappers)."
            )
    plain = nn_lora.merge(plain)  # left: Flax's nnx.LoRA wrappers' adapters
    owners = _owners(plain)
    wrapper_scale = 1.0 if scale is None else scale
    out: dict[str, jax.Array] = {}
    for path, value in _flat(plain, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))).items():
        owner = path[:-2] if len(path) >= 2 and path[-2] == _BASE else path[:-1]
        if owner in owners:
            path = (*owner, path[-1])
            if path[-1] == "kernel":
                a, b = owners[owner]
                delta = jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32))
                value = (value.astype(jnp.float32) + wrapper_scale * delta).astype(value.dtype)
        out[path_str(path)] = value
    return out
