"""Folding ``nn.lora``'s adapters back into their kernels (``merge``, ``delta``) and
finding the layers that hold them (``adapted_layers``). ``nn.lora`` re-exports each name.

An adapted layer's class (``nn.lora``'s ``LoRA<Base>``) names the class it adapts in
``lora_base_class``; folding sets the layer back to it.
"""

from __future__ import annotations

from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_spmd_trainer.nn.lora_kernel import Kernel, fresh_letters, kernel_of, kernel_sizes

__all__ = ["Model", "adapted_layers", "delta", "is_adapted", "layers_by_path", "merge"]

#: The model type ``nn.lora.apply`` and ``merge`` give back.
Model = TypeVar("Model", bound=nnx.Module)


def is_adapted(module: Any) -> bool:
    """Whether ``module`` holds ``nn.lora``'s adapters (its class is an adapted one)."""
    return isinstance(module, nnx.Module) and hasattr(type(module), "lora_base_class")


def layers_by_path(model: nnx.Module) -> dict[str, nnx.Module]:
    """Every module of ``model`` by its path (``"h/0/attn/q"``; the model itself ``""``)."""
    return {"/".join(map(str, path)): m for path, m in nnx.iter_modules(model)}


def adapted_layers(model: nnx.Module) -> dict[str, Any]:
    """The layers of ``model`` that hold adapters, by path."""
    return {p: m for p, m in layers_by_path(model).items() if is_adapted(m)}


def delta(layer: nnx.Module) -> jax.Array:
    """``alpha / rank * A @ B`` of an adapted layer, shaped (and laid out) as its kernel,
    in float32 (the update ``merge`` adds)."""
    if not is_adapted(layer):
        raise TypeError(f"delta: {type(layer).__name__} holds no adapters.")
    adapted: Any = layer  # lora_a, lora_b and lora_scale beside its kernel
    kernel = kernel_of(layer)
    assert isinstance(kernel, Kernel)
    lead_shape, _, _ = kernel_sizes(layer, kernel)
    lead = fresh_letters(kernel.letters, len(lead_shape) + 1)
    lead, rank = lead[:-1], lead[-1]
    a = adapted.lora_a.get_value().astype(jnp.float32)
    b = adapted.lora_b.get_value().astype(jnp.float32)
    spec = f"{lead}{kernel.inputs}{rank},{lead}{rank}{kernel.outputs}->{lead}{kernel.letters}"
    return jnp.einsum(spec, a, b, precision=jax.lax.Precision.HIGHEST) * adapted.lora_scale


def merge(model: Model) -> Model:
    """Folds every layer's adapters into its kernel (``W + alpha / rank * A @ B``, in the
    kernel's dtype) and removes them, in place; returns ``model``, a model of the base's
    structure that computes what the adapted one did (for export through the base's map).
    """
    for module in adapted_layers(model).values():
        weight = module.kernel.get_value()
        module.kernel.set_value((weight.astype(jnp.float32) + delta(module)).astype(weight.dtype))
        for name in ("lora_a", "lora_b", "lora_scale", "lora_dropout"):
            if name in vars(module):
                delattr(module, name)
        module.__class__ = type(module).lora_base_class
    return model
