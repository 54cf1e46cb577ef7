"""Key-value caches for decoding, in Flax's own convention.

Flax's ``nnx.MultiHeadAttention(decode=True)`` holds its cache in three
``nnx.Cache`` variables (``cached_key``, ``cached_value``: ``[batch, length,
heads, head_dim]``; ``cache_index``: the next position, one for the whole batch),
made by ``init_cache(input_shape, dtype)``; each call then takes one position,
writes it at ``cache_index`` and attends to the positions written so far. Any
module with a ``decode`` attribute and that ``init_cache`` takes part:
``init_caches`` prepares every one of a model, and ``update_cache`` is the step
for an attention of one's own (the shipped GPT-2's).

A stack of blocks (``stack.stacked``: parameters with a leading ``LAYERS``
dimension) gets caches with the same leading dimension, so ``nnx.scan`` hands
each layer its own.

Besides Flax's three, ``init_caches`` gives each cache module a ``cache_mask``
(``[batch, length]``, True where a cached position is a real token, False for a
prompt's left padding), written by ``set_cache_mask`` and read by the attentions
that know it (``MaskedAttention``, ``update_cache``): a model hides the padding
from every layer without threading a mask through its blocks. A plain
``nnx.MultiHeadAttention`` ignores it; pass the mask to its call instead.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_spmd_trainer.sharding import LAYERS

__all__ = ["MaskedAttention", "cache_modules", "init_caches", "set_cache_mask", "update_cache"]


def cache_modules(model: nnx.Module) -> list[Any]:
    """The modules of ``model`` that decode with a cache: a ``decode`` attribute and an
    ``init_cache`` method (``nnx.MultiHeadAttention``, the shipped GPT-2's attention)."""
    return [
        module
        for _, module in model.iter_modules()
        if hasattr(module, "decode") and callable(getattr(module, "init_cache", None))
    ]


def _stacked_layers(module: nnx.Module) -> int | None:
    """The size of the leading ``LAYERS`` dimension of ``module``'s parameters (a stack
    from ``stack.stacked``), else ``None``."""
    for _, variable in nnx.iter_graph(module):
        if not isinstance(variable, nnx.Param):
            continue
        names = variable.get_metadata().get("out_sharding") or ()
        if names and names[0] == LAYERS:
            return int(variable.shape[0])
    return None


def init_caches(model: nnx.Module, batch: int, length: int, dtype: Any = jnp.float32) -> int:
    """Gives every cache module of ``model`` an empty cache of ``batch`` rows and
    ``length`` positions and turns its ``decode`` on; returns how many it prepared.

    Call it on a copy (``nnx.merge`` of a split), never on a model that trains: the
    caches are new ``nnx.Cache`` variables of the model.

    >>> mha = nnx.MultiHeadAttention(2, 4, decode=False, rngs=nnx.Rngs(0))
    >>> init_caches(mha, batch=3, length=5), mha.cached_key.shape, mha.decode
    (1, (3, 5, 2, 2), True)
    """
    modules = cache_modules(model)
    for module in modules:
        module.init_cache((batch, length, 1), dtype)  # the last entry (features) is unread
        module.decode = True
        layers = _stacked_layers(module)
        module.cache_mask = nnx.Cache(jnp.ones((batch, length), bool))
        if layers is None:
            continue
        for name in ("cached_key", "cached_value", "cache_index", "cache_mask"):
            variable = getattr(module, name)
            value = variable[...]
            setattr(module, name, nnx.Cache(jnp.broadcast_to(value, (layers, *value.shape))))
    return len(modules)


def set_cache_mask(model: nnx.Module, mask: jax.Array) -> None:
    """Writes ``mask`` (``[batch, 1, 1, length]`` or ``[batch, length]``: the cached
    positions each row may attend to) into every ``cache_mask`` of ``model``."""
    rows = mask.reshape(mask.shape[0], mask.shape[-1]).astype(bool)
    for module in cache_modules(model):
        variable = getattr(module, "cache_mask", None)
        if variable is not None:
            variable[...] = jnp.broadcast_to(rows, variable.shape)


def _with_cache_mask(module: nnx.Module, mask: jax.Array | None) -> jax.Array | None:
    """``mask`` and the module's ``cache_mask`` (as ``[batch, 1, 1, length]``), if it has one."""
    variable = getattr(module, "cache_mask", None)
    if variable is None:
        return mask
    kept = variable[...][:, None, None, :]
    return kept if mask is None else jnp.logical_and(mask, kept)


class MaskedAttention(nnx.MultiHeadAttention):
    """``nnx.MultiHeadAttention`` whose decode step also hides what its ``cache_mask``
    marks (a sampler's left padding); otherwise, and in training, exactly Flax's. Its
    parameters are Flax's, under the same names.
    """

    def __call__(self, inputs_q: jax.Array, *args: Any, **kwargs: Any) -> jax.Array:
        decode = kwargs.get("decode")
        if decode if decode is not None else self.decode:
            kwargs["mask"] = _with_cache_mask(self, kwargs.get("mask"))
        return super().__call__(inputs_q, *args, **kwargs)


def update_cache(module: Any, key: jax.Array, value: jax.Array) -> tuple[Any, Any, Any]:
    """One decode step of ``module``'s cache, as ``nnx.MultiHeadAttention`` takes it:
    ``key``/``value`` (``[batch, 1, heads, head_dim]``) written at ``cache_index``, which
    moves on; returns the whole cached keys and values and the mask of the positions
    written so far (``[batch, 1, 1, length]``) that its ``cache_mask`` keeps.
    """
    if getattr(module, "cached_key", None) is None:
        raise ValueError(
            f"{type(module).__name__}: decode=True with no cache; call init_cache first "
            "(nn.kv_cache.init_caches prepares a whole model)."
        )
    cached_key, cached_value, index = module.cached_key, module.cached_value, module.cache_index
    batch, length = cached_key.shape[0], cached_key.shape[1]
    if key.shape != (batch, 1, *cached_key.shape[2:]):
        raise ValueError(
            f"{type(module).__name__}: a decode step takes one position of shape "
            f"{(batch, 1, *cached_key.shape[2:])}; got keys of shape {key.shape}."
        )
    where = index[...]
    zero = jnp.zeros((), where.dtype)
    cached_key[...] = jax.lax.dynamic_update_slice(cached_key[...], key, (zero, where, zero, zero))
    cached_value[...] = jax.lax.dynamic_update_slice(
        cached_value[...], value, (zero, where, zero, zero)
    )
    index[...] = where + 1
    written = jnp.broadcast_to(jnp.arange(length) <= where, (batch, 1, 1, length))
    return cached_key[...], cached_value[...], _with_cache_mask(module, written)
