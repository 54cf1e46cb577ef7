"""The sampler's two compiled programs, on the plan's mesh: prefill and one decode step.

Both run a *copy* of the model (``nnx.merge`` of the live state, in eval mode, its
caches made by ``nn.kv_cache.init_caches``), so the training state is only read.
Prefill runs the whole prompt block through the model in one pass, writing every
prompt position's keys and values at once (where every attention takes a block:
``nn.kv_cache.decodes_blocks``; Flax's own ``nnx.MultiHeadAttention`` takes one
position a call, so a model built on it is prefilled one column at a time).
Each program is compiled once per shape bucket (rows, prompt columns, cache length),
ahead of its first call (``jax.jit(...).lower(...).compile()``: no call is timed with
its compilation), and kept in the plan's one cache of compiled steps (``Plan.steps``);
the decode step is handed the cache and donates it, writing the next one into the
same buffers.

Layout: the rows are split as the plan splits a batch's rows (``Plan.batch_axes``),
the cache's rows with them, and the cache's heads over the tensor-parallel
(``"model"``-role: ``Plan.axis_roles``) axes the attention's heads are split over.

A layout that does not decode (a pipeline's layers split over stages, a sequence
split over devices: ``UNDECODABLE``) is resharded once per state: the weights are
copied into the same mesh without those axes (``resharded``, ``note`` says so in one
line), traced without that strategy's context; the training state is untouched.

Prompts are **left padded**: every row's last prompt token sits in the same
column, so one cache position serves the whole batch (Flax's ``cache_index`` is one
number). The padding is hidden by the key mask and each row's positions count from
its first real token, so a row decodes exactly as it would alone.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_spmd_trainer import sharding as sh
from nnx_spmd_trainer.generate.sampling import Choice, Sampling, choose, row_key
from nnx_spmd_trainer.nn.kv_cache import decodes_blocks, init_caches
from nnx_spmd_trainer.planner.plan import Plan

__all__ = ["DecodePrograms"]

#: The mesh-axis roles whose layouts do not decode, and what they are called.
UNDECODABLE = {"stage": "a pipeline", "seq": "a sequence split"}

#: What a step returns: the cache and each row's choice (``sampling.Choice``).
StepOut = tuple[Any, Choice]


def _choose(
    logits: jax.Array, seed: jax.Array, step: jax.Array, rows: jax.Array, how: Sampling
) -> Choice:
    """Each row's next token from its own key, with its log-probabilities."""
    keys = jax.vmap(lambda row: row_key(seed, step, row))(rows)
    return Choice(*jax.vmap(lambda lg, k: choose(lg, k, how))(logits, keys))


class DecodePrograms:
    """Prefill and decode for ``model`` laid out by ``plan`` (the live model is read only).

    Args:
      model: the trained ``nnx.Module`` (its arrays sharded on ``plan.mesh``).
      plan: the plan it was trained with.
      cache_dtype: the cache's dtype (default float32).
    """

    def __init__(self, model: nnx.Module, plan: Plan, *, cache_dtype: Any = jnp.float32) -> None:
        self.plan = plan
        self.cache_dtype = cache_dtype
        self._model = model
        self._graphdef, state = nnx.split(model)
        self._treedef = jax.tree.structure(state)
        mesh, roles = plan.mesh, plan.axis_roles()
        #: The mesh axes resharded away (a pipeline's, a sequence split's): ``()`` mostly.
        self.resharded = tuple(
            a for a, role in roles.items() if role in UNDECODABLE and mesh.shape.get(a, 1) > 1
        )
        #: One line saying what was resharded, or ``None``.
        self.note = None
        if self.resharded:
            kinds = sorted({UNDECODABLE[roles[a]] for a in self.resharded})
            self.note = (
                f"{plan.strategy!r} lays the model out as {' and '.join(kinds)}, which does not "
                f"decode: sampling from a copy of the weights without the {self.resharded} "
                "axes (the training state is untouched)."
            )
        self.row_axes = tuple(
            a for a in plan.batch_axes() if a not in self.resharded and mesh.shape.get(a, 1) > 1
        )
        self._copied: tuple[list[int], list[Any]] | None = None
        #: Whether prefill runs the prompts in one pass (every attention takes a block of
        #: positions: ``nn.kv_cache.decodes_blocks``), else one column at a time.
        self.one_pass_prefill = decodes_blocks(model)

    # -- layout --------------------------------------------------------------------
    def state_leaves(self) -> list[Any]:
        """The model's arrays now (the trainer's steps replace them), copied into a layout
        that decodes when the training layout does not (once per state)."""
        live = jax.tree.leaves(nnx.state(self._model))
        if not self.resharded:
            return live
        ids = [id(x) for x in live]
        if self._copied is None or self._copied[0] != ids:
            self._copied = (
                ids,
                [jax.device_put(x, self._decodable(x.sharding, x.ndim)) for x in live],
            )
        return self._copied[1]

    def _decodable(self, sharding: NamedSharding, ndim: int) -> NamedSharding:
        dims = sh.dimension_axes(sharding.spec, ndim)
        kept = [tuple(a for a in axes if a not in self.resharded) or None for axes in dims]
        return NamedSharding(self.plan.mesh, P(*kept))

    @contextlib.contextmanager
    def _tracing(self, batch_shardings: Any) -> Iterator[None]:
        """The plan's trace context; none where the layout was resharded (a pipeline's
        schedule or a sequence split's rules would take the copy for theirs)."""
        if self.resharded:
            yield
            return
        with self.plan.trace_context(batch_shardings):
            yield

    @property
    def row_multiple(self) -> int:
        """Rows are padded to a multiple of this (the devices splitting them)."""
        return math.prod(self.plan.mesh.shape[a] for a in self.row_axes)

    def _rows(self, *rest: Any) -> NamedSharding:
        return NamedSharding(self.plan.mesh, P(self.row_axes or None, *rest))

    def on_devices(self, *arrays: Any) -> list[jax.Array]:
        """``arrays`` (host arrays of ``rows`` leading rows, or scalars) placed as the
        programs take them: the rows split, scalars replicated. Placed once per
        ``generate``, not per step: a step's call then moves nothing from the host but its
        step number."""
        return [
            jax.device_put(x, self._rows(*(None,) * (np.ndim(x) - 1)) if np.ndim(x) else
                           self.plan.replicated)
            for x in arrays
        ]  # fmt: skip

    def _heads_axes(self, heads: int) -> tuple[str, ...]:
        """The tensor-parallel axes (role ``"model"``) that divide ``heads``, as the
        attention's projections split them; none when the rows already use them."""
        mesh, roles = self.plan.mesh, self.plan.axis_roles()
        axes = tuple(
            a for a, role in roles.items()
            if role == "model" and a not in self.row_axes and mesh.shape.get(a, 1) > 1
        )  # fmt: skip
        return axes if axes and heads % math.prod(mesh.shape[a] for a in axes) == 0 else ()

    def _cache_sharding(self, leaf: jax.ShapeDtypeStruct) -> NamedSharding:
        rows = self.row_axes or None
        if jnp.dtype(leaf.dtype) == jnp.dtype(bool):  # cache_mask: [(layers,) rows, length]
            return NamedSharding(self.plan.mesh, P(*(None,) * (leaf.ndim - 2), rows, None))
        if leaf.ndim < 4:  # cache_index (one per layer when stacked)
            return NamedSharding(self.plan.mesh, P())
        lead = (None,) * (leaf.ndim - 4)  # a stack's layer dimension
        heads = self._heads_axes(leaf.shape[-2]) or None
        return NamedSharding(self.plan.mesh, P(*lead, self.row_axes or None, None, heads, None))

    # -- the decoding copy -----------------------------------------------------------
    def _decoding_copy(self, leaves: list[Any], rows: int, length: int) -> nnx.Module:
        model = nnx.merge(self._graphdef, jax.tree.unflatten(self._treedef, leaves))
        model.eval()
        if not init_caches(model, rows, length, self.cache_dtype):
            raise TypeError(
                f"{type(model).__name__} has no attention that decodes with a cache: build "
                "its attention as nnx.MultiHeadAttention(..., decode=False) (or give your own "
                "a `decode` attribute and init_cache, as Flax's); see docs/topics/sampling.md."
            )
        return model

    def cache_bytes_per_device(self, rows: int, length: int) -> int:
        """The bytes of the cache each device holds for ``rows`` x ``length``."""
        _, cache = self._abstract(rows, length)
        total = 0
        for leaf in jax.tree.leaves(cache):
            shard = self._cache_sharding(leaf).shard_shape(leaf.shape)
            total += math.prod(shard) * jnp.dtype(leaf.dtype).itemsize
        return total

    def _abstract(self, rows: int, length: int) -> tuple[nnx.GraphDef[Any], Any]:
        leaves = self.state_leaves()
        graphdefs = []

        # jax.eval_shape, not nnx.eval_shape: shapes only, no sharding made from the
        # annotations (a mesh in force, inside a fit, need not name the axes they name).
        def caches(leaves: list[Any]) -> Any:
            graphdef, cache, *_ = nnx.split(
                self._decoding_copy(leaves, rows, length), nnx.Cache, ...
            )
            graphdefs.append(graphdef)
            return cache

        cache = jax.eval_shape(caches, leaves)
        return graphdefs[0], cache

    # -- the programs ------------------------------------------------------------------
    def prefill(
        self, rows: int, columns: int, length: int, how: Sampling
    ) -> Callable[..., StepOut]:
        """``(state, tokens, positions, real, seed, row_ids) -> (cache, token, logp)``:
        the prompts (``[rows, columns]``, left padded) run into a fresh cache in one pass
        (a model whose attention takes one position a call, as Flax's own: one column at
        a time), then each row's first token chosen (decode step 0)."""
        key = ("generate/prefill", self._graph, rows, columns, length, how, self.cache_dtype)
        return self.plan.steps.get(key, lambda: self._compile(rows, columns, length, how, True)).fn

    def decode(self, rows: int, length: int, how: Sampling) -> Callable[..., StepOut]:
        """``(state, cache, tokens, lengths, real, seed, step, row_ids) -> (cache, token,
        logp)``: one position for every row (each row's ``lengths + step - 1``: the prompt's
        length counts its first position 0); the cache is donated."""
        key = ("generate/decode", self._graph, rows, length, how, self.cache_dtype)
        return self.plan.steps.get(key, lambda: self._compile(rows, 1, length, how, False)).fn

    @property
    def _graph(self) -> int:
        """The model's graph in the plan's cache keys: another model's programs are its own."""
        return self.plan.steps.graph_id(self._graphdef)

    def _compile(self, rows: int, columns: int, length: int, how: Sampling, fresh: bool) -> Any:
        """The program, compiled now (ahead of its first call, so no call is timed with
        its compilation); ``fresh``: prefill, else a decode step."""
        graphdef, abstract_cache = self._abstract(rows, length)
        cache_tree = jax.tree.structure(abstract_cache)
        cache_shardings = [self._cache_sharding(x) for x in jax.tree.leaves(abstract_cache)]
        treedef, abstract_leaves = self._treedef, jax.tree.leaves(abstract_cache)
        tokens_sharding = self._rows(None)
        batch_shardings = {"tokens": tokens_sharding}
        one_pass = self.one_pass_prefill

        def forward(
            state: Any, cache: Any, tokens: jax.Array, positions: jax.Array, real: jax.Array
        ) -> tuple[Any, jax.Array]:
            """The last column's logits of ``tokens`` (``[rows, columns]``, written into the
            cache from its index on) and the cache they leave; ``real``: the cached
            positions each row may attend to."""
            model = nnx.merge(graphdef, state, jax.tree.unflatten(cache_tree, cache))
            logits = model(tokens, positions=positions, mask=real[:, None, None, :])
            return jax.tree.leaves(nnx.state(model, nnx.Cache)), logits[:, -1].astype(jnp.float32)

        def by_columns(leaves, cache, tokens, positions, real):  # type: ignore[no-untyped-def]
            """Prefill one column at a time (Flax's attention takes one position a call).
            The state rides in the carry: NNX refuses variables closed over from outside
            the scan (a scanned model's nnx.scan checks their trace)."""

            def column(carry: Any, t: jax.Array) -> tuple[Any, None]:
                state, cache, _ = carry
                own = real | (jnp.arange(length) == t)  # a padding query sees itself
                column_tokens, column_positions = (
                    jax.lax.dynamic_slice_in_dim(a, t, 1, axis=1) for a in (tokens, positions)
                )
                state_tree = jax.tree.unflatten(treedef, state)
                cache, logits = forward(state_tree, cache, column_tokens, column_positions, own)
                return (state, cache, logits), None

            none = jnp.zeros((rows, 0), jnp.float32)
            vocab = jax.eval_shape(column, (leaves, cache, none), 0)[0][2].shape[-1]
            start = (leaves, cache, jnp.zeros((rows, vocab), jnp.float32))
            (_, cache, logits), _ = jax.lax.scan(column, start, jnp.arange(columns))
            return cache, logits

        def prefill(leaves, tokens, positions, real, seed, row_ids):  # type: ignore[no-untyped-def]
            with self._tracing(batch_shardings):
                cache = [jnp.zeros(x.shape, x.dtype) for x in abstract_leaves]
                if one_pass:
                    state = jax.tree.unflatten(treedef, leaves)
                    cache, logits = forward(state, cache, tokens, positions, real)
                else:
                    cache, logits = by_columns(leaves, cache, tokens, positions, real)
                return cache, _choose(logits, seed, jnp.int32(0), row_ids, how)

        def decode(leaves, cache, tokens, lengths, real, seed, step, row_ids):  # type: ignore[no-untyped-def]
            with self._tracing(batch_shardings):
                state = jax.tree.unflatten(treedef, leaves)
                positions = (lengths + step - 1)[:, None]
                cache, logits = forward(state, cache, tokens[:, None], positions, real)
                return cache, _choose(logits, seed, step, row_ids, how)

        row = self._rows()
        state = [
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in self.state_leaves()
        ]
        scalar = {"sharding": self.plan.replicated}
        seed = jax.ShapeDtypeStruct((), jnp.uint32, **scalar)
        row_ids = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=row)
        real = jax.ShapeDtypeStruct((rows, length), jnp.bool_, sharding=tokens_sharding)
        program: Callable[..., Any]
        args: tuple[Any, ...]
        donate: tuple[int, ...]
        if fresh:
            block = jax.ShapeDtypeStruct((rows, columns), jnp.int32, sharding=tokens_sharding)
            program, args, donate = prefill, (state, block, block, real, seed, row_ids), ()
        else:
            cache = [
                jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
                for x, s in zip(abstract_leaves, cache_shardings, strict=True)
            ]
            column = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=row)
            step = jax.ShapeDtypeStruct((), jnp.int32, **scalar)
            program = decode
            args, donate = (state, cache, column, column, real, seed, step, row_ids), (1,)
        with jax.set_mesh(self.plan.mesh):
            jitted = self.plan.compile_program(
                program,
                in_shardings=jax.tree.map(lambda x: x.sharding, args),
                out_shardings=(cache_shardings, Choice(row, row, row, row)),
                donate_argnums=donate,
            )
            lower = getattr(jitted, "lower", None)  # a strategy's own wrapper may not lower
            return jitted if lower is None else lower(*args).compile()
