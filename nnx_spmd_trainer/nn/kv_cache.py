"""Key-value caches for decoding, in Flax's own convention.

Flax's ``nnx.MultiHeadAttention(decode=True)`` holds its cache in three
``nnx.Cache`` variables (``cached_key``, ``cached_value``: ``[batch, length,
heads, head_dim]``; ``cache_index``: the next position, one for the whole batch),
made by ``init_cache(input_shape, dtype)``; each call then takes one position,
writes it at ``cache_index`` and attends to the positions written so far. Any
module with a ``decode`` attribute and that ``init_cache`` takes part:
``init_caches`` prepares every one of a model, and ``update_cache`` is the step
for an attention of one's own (the shipped GPT-2's).

``update_cache`` also takes a *block* of positions at once (a whole prompt: one
prefill pass writes every prompt position's keys and values, each query seeing the
cached positions up to its own). An attention that decodes blocks says so with a
``decodes_blocks = True`` attribute (``MaskedAttention``, GPT-2's); a model all of
whose cache modules do is prefilled in one pass (``decodes_blocks``), any other
(Flax's own ``nnx.MultiHeadAttention``, which takes one position a call) one
position at a time.

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

__all__ = [
    "MaskedAttention",
    "cache_modules",
    "decodes_blocks",
    "init_caches",
    "set_cache_mask",
    "update_cache",
]


def cache_modules(model: nnx.Module) -> list[Any]:
    """The modules of ``model`` that decode with a cache: a ``decode`` attribute and an
    ``init_cache`` method (``nnx.MultiHeadAttention``, the shipped GPT-2's attention)."""
    return [
        module
        for _, module in nnx.iter_modules(model)
        if hasattr(module, "decode") and callable(getattr(module, "init_cache", None))
    ]


def decodes_blocks(model: nnx.Module) -> bool:
    """Whether every cache module of ``model`` takes a block of positions in one decode
    call (a ``decodes_blocks = True`` attribute): then a prompt is prefilled in one pass.

    >>> decodes_blocks(nnx.MultiHeadAttention(2, 4, decode=False, rngs=nnx.Rngs(0)))
    False
    >>> decodes_blocks(MaskedAttention(2, 4, decode=False, rngs=nnx.Rngs(0)))
    True
    """
    modules = cache_modules(model)
    return bool(modules) and all(getattr(m, "decodes_blocks", False) for m in modules)


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
    """``nnx.MultiHeadAttention`` whose decode call takes a block of positions
    (``update_cache``: a whole prompt in one prefill pass, or one position a step) and
    hides what its ``cache_mask`` marks (a sampler's left padding); in training exactly
    Flax's. Its parameters are Flax's, under the same names. Decoding, it attends to
    itself only (``inputs_k``/``inputs_v`` are not taken), with no attention dropout.
    """

    #: Its decode call takes a block of positions (``decodes_blocks``).
    decodes_blocks = True

    def __call__(self, inputs_q: jax.Array, *args: Any, **kwargs: Any) -> jax.Array:
        decode = kwargs.get("decode")
        if not (decode if decode is not None else self.decode):
            return super().__call__(inputs_q, *args, **kwargs)
        if args or kwargs.get("inputs_k") is not None or kwargs.get("inputs_v") is not None:
            raise ValueError(
                f"{type(self).__name__}: decoding is self-attention; call it with inputs_q only."
            )
        query, key, value = self.query(inputs_q), self.key(inputs_q), self.value(inputs_q)
        if self.normalize_qk:
            assert self.query_ln is not None and self.key_ln is not None
            query, key = self.query_ln(query), self.key_ln(key)
        key, value, visible = update_cache(self, key, value)
        mask = kwargs.get("mask")
        mask = visible if mask is None else jnp.logical_and(mask.astype(bool), visible)
        x = self.attention_fn(
            query, key, value, mask=mask, dropout_rng=None, dropout_rate=0.0,
            broadcast_dropout=self.broadcast_dropout, deterministic=True, dtype=self.dtype,
            precision=self.precision, module=None,
        )  # fmt: skip
        return self.out(x)


def update_cache(module: Any, key: jax.Array, value: jax.Array) -> tuple[Any, Any, Any]:
    """A decode call's write into ``module``'s cache, as ``nnx.MultiHeadAttention``
    takes one position, or a block of them: ``key``/``value`` (``[batch, block, heads,
    head_dim]``) written from ``cache_index``, which moves on by ``block``. Returns the
    whole cached keys and values and what each of the block's queries may attend to
    (``[batch, 1, block, length]``): the positions up to its own that the module's
    ``cache_mask`` keeps, and always itself (a padding query then attends to something,
    so nothing it computes is NaN; real queries never see it, the mask hides it).
    """
    if getattr(module, "cached_key", None) is None:
        raise ValueError(
            f"{type(module).__name__}: decode=True with no cache; call init_cache first "
            "(nn.kv_cache.init_caches prepares a whole model)."
        )
    cached_key, cached_value, index = module.cached_key, module.cached_value, module.cache_index
    batch, length = cached_key.shape[0], cached_key.shape[1]
    block = key.shape[1] if key.ndim == 4 else 0
    if key.shape != (batch, block, *cached_key.shape[2:]) or not 0 < block <= length:
        raise ValueError(
            f"{type(module).__name__}: a decode call takes keys of shape (batch={batch}, "
            f"positions<={length}, *{tuple(cached_key.shape[2:])}); got {key.shape}."
        )
    where = index[...]
    zero = jnp.zeros((), where.dtype)
    # Written in the cache's dtype (a float32 cache beside bfloat16 compute, the sampler's
    # default) and read back in the keys' own: attention takes one dtype, and a bfloat16
    # key comes back from a float32 cache as it went in.
    key_dtype, value_dtype = key.dtype, value.dtype
    key, value = key.astype(cached_key.dtype), value.astype(cached_value.dtype)
    cached_key[...] = jax.lax.dynamic_update_slice(cached_key[...], key, (zero, where, zero, zero))
    cached_value[...] = jax.lax.dynamic_update_slice(
        cached_value[...], value, (zero, where, zero, zero)
    )
    index[...] = where + block
    queries = where + jnp.arange(block)[:, None]  # [block, 1]: each query's position
    keys = jnp.arange(length)[None, :]
    written = jnp.broadcast_to(keys <= queries, (batch, 1, block, length))
    kept = _with_cache_mask(module, written)
    assert kept is not None
    return (
        cached_key[...].astype(key_dtype),
        cached_value[...].astype(value_dtype),
        jnp.logical_or(kept, keys == queries),
    )
