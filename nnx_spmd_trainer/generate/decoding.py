"""How a model decodes with a key-value cache: the two conventions a sampler serves.

- **The cache inside the model** (Flax's convention, ``CacheInModules``): its attention
  modules hold ``nnx.Cache`` variables (``nnx.MultiHeadAttention``: a ``decode``
  attribute and ``init_cache``; ``nn.kv_cache.init_caches`` prepares a copy), and it
  is called ``model(tokens, positions=..., mask=...)``: a block of tokens
  (``[rows, positions]``), each token's position, and the cached positions each row
  may attend to (``[rows, 1, 1, cache_length]``), returning logits
  ``[rows, positions, vocab]``.
- **The cache as an argument** (the JAX model zoo's, jax-ml/bonsai's:
  ``CacheArgument``): ``init_cache(batch_size, token_len, generate_steps, dtype)``
  makes it (bonsai's ``functools.partial(modeling.init_cache, config)``), and the
  model is called ``model(tokens, cache=cache, segment_ids=segment_ids)``
  (``segment_ids`` 1 for a token, 0 for left padding), keeping its own positions in
  the cache and writing it in place.

Both are pure functions of the state's leaves and the cache's leaves here, traced
inside the sampler's programs (``programs``); the live model is never written.

A model says how long a context it takes through ``ContextLength`` (a
``context_length`` attribute); one that does not is unchecked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_spmd_trainer.nn.kv_cache import decodes_blocks, init_caches

__all__ = ["CacheArgument", "CacheInModules", "ContextLength", "context_length"]


@runtime_checkable
class ContextLength(Protocol):
    """A model that says how many positions it takes (prompt and generated): the
    shipped GPT's ``seq_len``, GPT-2's ``n_positions``. The sampler refuses a call
    that would run past it, before anything is compiled."""

    @property
    def context_length(self) -> int: ...


def context_length(model: object) -> int | None:
    """``model.context_length`` where the model declares it (``ContextLength``), else
    ``None``."""
    if isinstance(model, ContextLength) and isinstance(model.context_length, int):
        return model.context_length
    return None


#: What a decoding convention's step gives: the cache's leaves and each row's logits
#: for its last position (``[rows, vocab]``, float32).
Forward = tuple[list[Any], jax.Array]


class CacheInModules:
    """Flax's convention: the cache lives in the model's ``nnx.Cache`` variables."""

    def __init__(self, model: nnx.Module, cache_dtype: Any) -> None:
        self._graphdef, state = nnx.split(model)
        self._treedef = jax.tree.structure(state)
        self.cache_dtype = cache_dtype
        #: Whether prefill runs the prompts in one pass (every attention takes a block of
        #: positions: ``nn.kv_cache.decodes_blocks``), else one column at a time.
        self.one_pass_prefill = decodes_blocks(model)
        self.name = type(model).__name__
        self._cache: dict[tuple[int, int], tuple[nnx.GraphDef[Any], Any]] = {}

    def _copy(self, leaves: list[Any], rows: int, length: int) -> nnx.Module:
        model = nnx.merge(self._graphdef, jax.tree.unflatten(self._treedef, leaves))
        model.eval()
        if not init_caches(model, rows, length, self.cache_dtype):
            raise TypeError(
                f"{self.name} has no attention that decodes with a cache: build its "
                "attention as nnx.MultiHeadAttention(..., decode=False) (or give your own a "
                "`decode` attribute and init_cache, as Flax's), or give Sampler(init_cache=...) "
                "for a model that takes its cache as an argument; see docs/topics/sampling.md."
            )
        return model

    def _structure(self, leaves: list[Any], rows: int, length: int) -> tuple[Any, Any]:
        """The decoding copy's graph and its cache's tree structure (shapes only)."""
        if (rows, length) not in self._cache:
            graphdefs = []

            def caches(leaves: list[Any]) -> Any:
                graphdef, cache, *_ = nnx.split(self._copy(leaves, rows, length), nnx.Cache, ...)
                graphdefs.append(graphdef)
                return cache

            abstract = jax.eval_shape(caches, leaves)
            self._cache[rows, length] = (graphdefs[0], abstract)
        return self._cache[rows, length]

    def abstract_cache(self, leaves: list[Any], rows: int, length: int) -> list[Any]:
        return jax.tree.leaves(self._structure(leaves, rows, length)[1])

    def new_cache(self, leaves: list[Any], rows: int, length: int) -> list[Any]:
        return [jnp.zeros(x.shape, x.dtype) for x in self.abstract_cache(leaves, rows, length)]

    def _forward(
        self, leaves: list[Any], cache: list[Any], tokens: jax.Array, positions: jax.Array,
        real: jax.Array,
    ) -> Forward:  # fmt: skip
        rows, length = real.shape
        graphdef, abstract = self._structure(leaves, rows, length)
        state = jax.tree.unflatten(self._treedef, leaves)
        cache_state = jax.tree.unflatten(jax.tree.structure(abstract), cache)
        model = nnx.merge(graphdef, state, cache_state)
        logits = model(tokens, positions=positions, mask=real[:, None, None, :])
        cache = jax.tree.leaves(nnx.state(model, nnx.Cache))
        return cache, logits[:, -1].astype(jnp.float32)

    def prefill(
        self, leaves: list[Any], cache: list[Any], tokens: jax.Array, positions: jax.Array,
        real: jax.Array,
    ) -> Forward:  # fmt: skip
        """The prompt block (``[rows, columns]``, left padded) into a fresh cache: in one
        pass, or one column at a time for an attention that takes one position a call."""
        if self.one_pass_prefill:
            return self._forward(leaves, cache, tokens, positions, real)
        rows, length = real.shape

        # The state rides in the carry: NNX refuses variables closed over from outside
        # the scan (a scanned model's nnx.scan checks their trace).
        def column(carry: Any, t: jax.Array) -> tuple[Any, None]:
            state, cache, _ = carry
            own = real | (jnp.arange(length) == t)  # a padding query sees itself
            column_tokens, column_positions = (
                jax.lax.dynamic_slice_in_dim(a, t, 1, axis=1) for a in (tokens, positions)
            )
            cache, logits = self._forward(state, cache, column_tokens, column_positions, own)
            return (state, cache, logits), None

        none = jnp.zeros((rows, 0), jnp.float32)
        vocab = jax.eval_shape(column, (leaves, cache, none), 0)[0][2].shape[-1]
        start = (leaves, cache, jnp.zeros((rows, vocab), jnp.float32))
        (_, cache, logits), _ = jax.lax.scan(column, start, jnp.arange(tokens.shape[1]))
        return cache, logits

    def decode(
        self, leaves: list[Any], cache: list[Any], token: jax.Array, position: jax.Array,
        real: jax.Array,
    ) -> Forward:  # fmt: skip
        """One position for every row (``token``, ``position``: ``[rows]``)."""
        return self._forward(leaves, cache, token[:, None], position[:, None], real)


class CacheArgument:
    """The zoo's convention: ``model(tokens, cache=cache, segment_ids=segment_ids)`` with
    a cache made by ``init_cache(batch_size, token_len, generate_steps, dtype)``.

    The model keeps its own positions (bonsai's Qwen3 counts them from the cache's
    index and each row's left padding), so ``positions`` and ``real`` are not passed
    (``real`` gives the cache length asked for; the model may round it up).
    """

    #: The prompt goes in one call (the model takes a block with its cache).
    one_pass_prefill = True

    def __init__(self, model: nnx.Module, init_cache: Callable[..., Any], cache_dtype: Any) -> None:
        self._graphdef, state = nnx.split(model)
        self._treedef = jax.tree.structure(state)
        self._init_cache = init_cache
        self.cache_dtype = cache_dtype
        self.name = type(model).__name__
        self._cache: dict[tuple[int, int], tuple[nnx.GraphDef[Any], Any]] = {}

    def _made(self, rows: int, length: int) -> Any:
        return nnx.split(self._init_cache(rows, length, 0, self.cache_dtype))

    def _structure(self, rows: int, length: int) -> tuple[Any, Any]:
        if (rows, length) not in self._cache:
            graphdefs = []

            def made() -> Any:
                graphdef, state = self._made(rows, length)
                graphdefs.append(graphdef)
                return state

            abstract = jax.eval_shape(made)
            self._cache[rows, length] = (graphdefs[0], abstract)
        return self._cache[rows, length]

    def abstract_cache(self, leaves: list[Any], rows: int, length: int) -> list[Any]:
        del leaves
        return jax.tree.leaves(self._structure(rows, length)[1])

    def new_cache(self, leaves: list[Any], rows: int, length: int) -> list[Any]:
        del leaves
        return jax.tree.leaves(self._made(rows, length)[1])

    def _forward(
        self, leaves: list[Any], cache: list[Any], tokens: jax.Array, segment_ids: jax.Array,
        length: int,
    ) -> Forward:  # fmt: skip
        graphdef, abstract = self._structure(tokens.shape[0], length)
        model = nnx.merge(self._graphdef, jax.tree.unflatten(self._treedef, leaves))
        model.eval()
        layers = nnx.merge(graphdef, jax.tree.unflatten(jax.tree.structure(abstract), cache))
        logits = model(tokens, cache=layers, segment_ids=segment_ids)
        return jax.tree.leaves(nnx.state(layers)), logits[:, -1].astype(jnp.float32)

    def prefill(
        self, leaves: list[Any], cache: list[Any], tokens: jax.Array, positions: jax.Array,
        real: jax.Array,
    ) -> Forward:  # fmt: skip
        del positions
        segments = real[:, : tokens.shape[1]].astype(jnp.int32)
        return self._forward(leaves, cache, tokens, segments, real.shape[1])

    def decode(
        self, leaves: list[Any], cache: list[Any], token: jax.Array, position: jax.Array,
        real: jax.Array,
    ) -> Forward:  # fmt: skip
        del position
        ones = jnp.ones_like(token, jnp.int32)[:, None]
        return self._forward(leaves, cache, token[:, None], ones, real.shape[1])
