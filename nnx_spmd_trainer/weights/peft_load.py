"""A PEFT adapter directory read into a model in one call: ``load_peft_adapter``
(``weights.peft`` writes and reads the directory; this puts its arrays in the layers)."""

from __future__ import annotations

import os
import re
from typing import Any, TypeVar

import jax
import numpy as np
from flax import nnx

from nnx_spmd_trainer.nn import lora as nn_lora
from nnx_spmd_trainer.weights.mapping import WeightMap
from nnx_spmd_trainer.weights.peft import PeftAdapter, _places, adapter_arrays, read_peft_adapter

__all__ = ["load_peft_adapter"]

#: The model type ``load_peft_adapter`` gives back.
Model = TypeVar("Model", bound=nnx.Module)


def load_peft_adapter(
    model: Model,
    directory: str | os.PathLike[str],
    weight_map: WeightMap,
    *,
    module_prefix: str | None = None,
) -> Model:
    """Reads the PEFT adapter in ``directory`` into ``model``, in place; returns ``model``.

    A model without adapters gets them first (``nn.lora.apply``): beside every kernel of
    the map that the adapter's modules cover, of the adapter's rank and with scale
    ``lora_alpha / r`` (a fused module's ``rank_pattern`` / ``alpha_pattern`` are read as
    PEFT reads them: the update is exact). A model that has adapters (``Trainer(lora=)``,
    ``nn.lora.apply``) keeps its rank and scale, the adapter's scale folded into B. The
    adapted model then computes what ``peft`` computes on the base with the adapter.

    >>> # model = GPT2(config, rngs=nnx.Rngs(0)); load_peft_adapter(model, "tiny-lora",
    >>> #     gpt2_weight_map(config))   # then model(tokens) is base + adapter

    Raises ``ValueError`` (``read_peft_adapter``'s, or a module of the adapter that no
    kernel of the map feeds).
    """
    adapter = read_peft_adapter(directory)
    if not nn_lora.adapted_layers(model):
        rank = int(adapter.config["r"])
        alpha = float(adapter.config["lora_alpha"])
        layers = _covered_layers(model, adapter, weight_map, module_prefix)
        if not layers:
            raise ValueError(
                f"{directory}: no kernel of the weight map feeds the adapter's modules "
                f"({adapter.modules()[:3]}): is it an adapter of this model?"
            )
        targets = tuple(re.escape(path) for path in layers)
        nn_lora.apply(model, nn_lora.LoRA(rank=rank, alpha=alpha, targets=targets))
    adapted = nn_lora.adapters(model)
    kernels = {path: tuple(np.shape(model_kernel(model, path))) for path in adapted}
    scales = {float(a.scale) for a in adapted.values()}
    ranks = {int(np.shape(a.a)[-1]) for a in adapted.values()}
    if len(scales) != 1 or len(ranks) != 1:
        raise ValueError("load_peft_adapter: the model's adapters differ in rank or scale.")
    rank, scale = ranks.pop(), scales.pop()
    arrays = adapter_arrays(
        adapter, weight_map, kernels, rank=rank, alpha=scale * rank, module_prefix=module_prefix
    )
    by_path = nn_lora.adapted_layers(model)
    for path, (a, b) in arrays.items():
        layer = by_path[path.removesuffix("/kernel")]
        for variable, value in ((layer.lora_a, a), (layer.lora_b, b)):
            old = variable.get_value()
            variable.set_value(_like(value, old))
    return model


def model_kernel(model: Any, path: str) -> Any:
    """The kernel array at ``path`` (``"h/0/attn/q/kernel"``) of ``model``."""
    node = model
    for key in path.split("/"):
        node = node[int(key)] if key.isdigit() and not hasattr(node, key) else getattr(node, key)
    return node.get_value() if hasattr(node, "get_value") else node


def _like(value: np.ndarray, old: Any) -> Any:
    """``value`` in ``old``'s dtype, and, for a ``jax.Array``, its sharding."""
    out = np.asarray(value, dtype=np.dtype(old.dtype))
    if isinstance(old, jax.Array):
        return jax.device_put(out, old.sharding)
    return out


def _covered_layers(
    model: Any, adapter: PeftAdapter, weight_map: WeightMap, module_prefix: str | None
) -> list[str]:
    """The paths of the layers whose kernels the adapter's modules cover."""
    known = set(adapter.modules())
    prefixes = ("", *weight_map.prefixes) if module_prefix is None else (module_prefix,)
    fan_in_fan_out = bool(adapter.config.get("fan_in_fan_out", False))
    found = []
    for path_parts, module in nnx.iter_modules(model):
        path = "/".join(map(str, path_parts))
        kernel_path = f"{path}/kernel" if path else "kernel"
        if not isinstance(module, nn_lora.ADAPTABLE) or kernel_path not in weight_map.targets:
            continue
        shape = tuple(np.shape(module.kernel.get_value()))
        try:
            places = _places(weight_map, kernel_path, shape, fan_in_fan_out)
        except ValueError:
            continue  # not written as a 2-D '.weight': no LoRA module
        if any(p + place.module in known for place in places for p in prefixes):
            found.append(path)
    return found
