"""The sampler's two compiled programs, on the plan's mesh: prefill, and the decode loop.

- **prefill** runs the left-padded prompt block into a fresh cache (in one pass where
  the model takes a block: ``decoding``) and chooses each row's first token.
- **decode** runs decode steps in one ``lax.while_loop`` on the devices, Tunix's
  ``_decode_fn`` design: each step feeds every row's last token, chooses the next,
  writes it and its log-probabilities into the output buffers, and marks a row done at
  the end token; the loop stops when every row is done or at the step ``until`` (a
  call's length, or the end of a block of steps: the host checks stop strings there).

A call without stop strings runs both as **one** program (``whole``: prefill, then the
loop, in one ``jax.jit``), a hand-written ``lax.while_loop`` decode's shape: one dispatch
and one read a call. It hands back one ``int32`` array (``pack``: the buffers, the
log-probabilities' bits, and each row's count, done and step), since on the CPU each
array read costs 25-30 us, a fifth of a batch-1 decode step. Its phases are then not timed
apart (``Sampler(phase_timing=True)`` keeps the two programs where they should be).

All run a *copy* of the model (``nnx.merge`` of the live state's leaves, in eval
mode), so the training state is only read. Each is compiled once per shape bucket
(rows, prompt columns, cache length, sampling settings), ahead of its first call
(``jax.jit(...).lower(...).compile()``: no call is timed with its compilation), and
kept in the plan's one cache of compiled steps (``Plan.steps``). How many steps a
call runs is an argument, not a shape: one decode program serves every length.
The decode program is handed the cache and donates it.

Layout: ``layout.DecodeLayout``. Prompts are **left padded**: every row's last prompt
token sits in the same column, so one cache position serves the whole batch; the
padding is hidden by the key mask and each row's positions count from its first real
token, so a row decodes exactly as it would alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from nnx_spmd_trainer.generate.decoding import CacheArgument, CacheInModules
from nnx_spmd_trainer.generate.layout import DecodeLayout
from nnx_spmd_trainer.generate.sampling import Choice, Sampling, choose, row_key
from nnx_spmd_trainer.planner.plan import Plan

__all__ = [
    "Carry",
    "DecodePrograms",
    "Inputs",
    "host_block",
    "host_scalars",
    "pack",
    "unpack",
]


class Carry(NamedTuple):
    """What the decode loop carries, and what a program hands back to the host.

    Attributes:
      step: the next decode step (prefill's choice is step 0).
      token: each row's last token (``[rows]``).
      done: each row has stopped (its end token; or a padding row; or the host's stop).
      taken: the tokens each row took (its end token included).
      out: each step's choice (``sampling.Choice`` of ``[rows, cache length]`` buffers,
        step ``s`` in column ``s``; a done row's later columns are not its own).
    """

    step: jax.Array
    token: jax.Array
    done: jax.Array
    taken: jax.Array
    out: Choice


def pack(carry: Carry, greedy: bool) -> jax.Array:
    """``carry`` as one ``int32`` array laid out as its rows (traced, at a program's end):
    the buffers (two when ``greedy``: tokens and log-probabilities; else four), each
    ``[rows, length]``, the float ones as their bits, then three columns: each row's
    count of tokens taken, its done, and the step reached."""
    buffers = carry.out[: 2 if greedy else 4]
    bits = [
        jax.lax.bitcast_convert_type(b, jnp.int32) if b.dtype != jnp.int32 else b for b in buffers
    ]
    # Each column from a row's value, so every piece is laid out as the rows.
    step = jnp.zeros_like(carry.taken) + carry.step
    counts = (carry.taken, carry.done.astype(jnp.int32), step)
    return jnp.concatenate([*bits, *(c[:, None] for c in counts)], axis=1)


def host_block(
    tokens: np.ndarray, positions: np.ndarray, real: np.ndarray, active: np.ndarray,
    lengths: np.ndarray,
) -> np.ndarray:  # fmt: skip
    """A call's per-row inputs as one ``int32`` host array, ``whole``'s argument: the
    prompts and their positions (``[rows, columns]`` each), the cache positions each row
    attends to (``[rows, length]``), then three columns: active, prompt length, row id.
    One fresh host array a call, not nine: on the CPU each costs a program call ~11 us."""
    ids = np.arange(len(lengths), dtype=np.int32)
    columns = (active[:, None], lengths[:, None], ids[:, None])
    return np.concatenate([tokens, positions, real, *columns], axis=1, dtype=np.int32)


def host_scalars(seed: int, end_token: int | None, until: int) -> np.ndarray:
    """``whole``'s other argument: the seed's bits, the end token (``-1``: none) and the
    step to decode until, as one ``int32`` array."""
    end = -1 if end_token is None else end_token
    return np.array([x % (1 << 32) for x in (seed, end, until)], np.uint32).view(np.int32)


def _from_host(block: jax.Array, scalars: jax.Array, columns: int, length: int) -> tuple[Any, ...]:
    """``host_block`` and ``host_scalars`` taken apart inside a program: ``(tokens,
    positions, active, inputs, until)``."""
    tokens, positions = block[:, :columns], block[:, columns : 2 * columns]
    real = block[:, 2 * columns : 2 * columns + length].astype(jnp.bool_)
    active, lengths, row_ids = (block[:, i] for i in (-3, -2, -1))
    seed = jax.lax.bitcast_convert_type(scalars[0], jnp.uint32)
    inputs = Inputs(lengths, real, seed, row_ids, scalars[1])
    return tokens, positions, active.astype(jnp.bool_), inputs, scalars[2]


def unpack(
    packed: np.ndarray, greedy: bool
) -> tuple[int, np.ndarray, np.ndarray, list[np.ndarray]]:
    """``pack``'s array on the host: the step reached, each row's done and count taken,
    and the buffers (views, the float ones read back from their bits)."""
    k = 2 if greedy else 4
    length = (packed.shape[1] - 3) // k
    buffers = [packed[:, i * length : (i + 1) * length] for i in range(k)]
    buffers[1:] = [b.view(np.float32) for b in buffers[1:]]
    return int(packed[0, -1]), packed[:, -2].astype(bool), packed[:, -3], buffers


class Inputs(NamedTuple):
    """A call's inputs the decode loop reads, as prefill hands them on (on the devices:
    the decode program's call moves nothing from the host but its step count).

    Attributes:
      lengths: each row's prompt length (``[rows]``).
      real: the cache positions each row may attend to (``[rows, cache length]``).
      seed: the sampling seed.
      row_ids: each row's index (its keys' third input: ``sampling.row_key``).
      end_token: the id that ends a row; ``-1``: none.
    """

    # Host arrays into prefill, device arrays out of it (and into decode).
    lengths: Any
    real: Any
    seed: Any
    row_ids: Any
    end_token: Any


class DecodePrograms:
    """Prefill and the decode loop for ``model`` laid out by ``plan``.

    Args:
      model: the trained ``nnx.Module`` (its arrays sharded on ``plan.mesh``).
      plan: the plan it was trained with.
      cache_dtype: the cache's dtype (default float32).
      init_cache: for a model that takes its cache as an argument (jax-ml/bonsai's
        convention: ``decoding.CacheArgument``), what makes it:
        ``init_cache(batch_size, token_len, generate_steps, dtype)``.
    """

    def __init__(
        self,
        model: nnx.Module,
        plan: Plan,
        *,
        cache_dtype: Any = jnp.float32,
        init_cache: Callable[..., Any] | None = None,
    ) -> None:
        self.plan = plan
        self.cache_dtype = cache_dtype
        self._model = model
        self.layout = DecodeLayout(model, plan)
        self.decoding: CacheInModules | CacheArgument = (
            CacheInModules(model, cache_dtype)
            if init_cache is None
            else CacheArgument(model, init_cache, cache_dtype)
        )
        self._graphdef = nnx.graphdef(model)

    # -- what the sampler reads ------------------------------------------------------
    @property
    def note(self) -> str | None:
        """One line saying the layout was resharded to decode, or ``None``."""
        return self.layout.note

    @property
    def resharded(self) -> tuple[str, ...]:
        return self.layout.resharded

    @property
    def row_multiple(self) -> int:
        return self.layout.row_multiple

    @property
    def one_pass_prefill(self) -> bool:
        return self.decoding.one_pass_prefill

    def state_leaves(self) -> list[Any]:
        return self.layout.state_leaves()

    def on_devices(self, *arrays: Any) -> list[jax.Array]:
        return self.layout.on_devices(*arrays)

    def _abstract_cache(self, rows: int, length: int) -> list[Any]:
        return self.decoding.abstract_cache(self.layout.abstract_state(), rows, length)

    def cache_bytes_per_device(self, rows: int, length: int) -> int:
        """The bytes of the cache each device holds for ``rows`` x ``length``."""
        with jax.set_mesh(self.plan.mesh):
            return self.layout.bytes_per_device(self._abstract_cache(rows, length))

    # -- the programs ------------------------------------------------------------------
    def prefill(
        self, rows: int, columns: int, length: int, how: Sampling
    ) -> Callable[..., tuple[Any, Carry, Inputs]]:
        """``(state, tokens, positions, active, inputs) -> (cache, carry, inputs)``: the
        prompts (``[rows, columns]``, left padded) run into a fresh cache, then each row's
        first token chosen (step 0); ``active``: the rows that are prompts (the others
        start done); ``inputs`` (``Inputs``) handed on to the decode program."""
        key = ("generate/prefill", self._graph, rows, columns, length, how, self.cache_dtype)
        build = lambda: self._compile(rows, columns, length, how, "prefill")  # noqa: E731
        return self.plan.steps.get(key, build).fn

    def decode(
        self, rows: int, length: int, how: Sampling, *, ends: bool = True
    ) -> Callable[..., tuple[Any, Carry]]:
        """``(state, cache, carry, inputs, until) -> (cache, carry)``: decode steps from
        ``carry.step`` until every row is done or the
        step ``until``; a row's position is ``lengths + step - 1`` (its prompt's length
        counts its first position 0). The cache is donated. ``ends=False`` (no end token
        to stop at): the loop runs to ``until`` without asking whether every row is done,
        a reduction over the rows (a collective when they are split) each step saved."""
        key = ("generate/decode", self._graph, rows, length, how, self.cache_dtype, ends)
        build = lambda: self._compile(rows, 1, length, how, "decode", ends)  # noqa: E731
        return self.plan.steps.get(key, build).fn

    def whole(
        self, rows: int, columns: int, length: int, how: Sampling, *, ends: bool = True
    ) -> Callable[..., jax.Array]:
        """``(state, block, scalars) -> packed``: ``prefill`` and then ``decode`` to the
        step ``until`` as one program, its inputs in two host arrays (``host_block``,
        ``host_scalars``) and the carry handed back as one (``pack``; no cache comes out:
        the call reads once, at its end)."""
        key = ("generate/whole", self._graph, rows, columns, length, how, self.cache_dtype, ends)
        build = lambda: self._compile(rows, columns, length, how, "whole", ends)  # noqa: E731
        return self.plan.steps.get(key, build).fn

    @property
    def _graph(self) -> int:
        """The model's graph in the plan's cache keys: another model's programs are its own."""
        return self.plan.steps.graph_id(self._graphdef)

    def _choose(
        self, logits: jax.Array, seed: jax.Array, step: jax.Array, rows: jax.Array,
        how: Sampling,
    ) -> Choice:  # fmt: skip
        """Each row's next token from its own key, with its log-probabilities."""
        keys = jax.vmap(lambda row: row_key(seed, step, row))(rows)
        if not self.layout.explicit:
            return Choice(*jax.vmap(lambda lg, k: choose(lg, k, how))(logits, keys))
        # Explicit axes: each row's logits whole on its devices, and every result laid
        # out as the rows (a value vmap broadcast, greedy's kept_min_logit, is not).
        split = self.layout.row_axes or None
        logits = jax.sharding.reshard(logits, P(split, None))
        chosen = jax.vmap(lambda lg, k: choose(lg, k, how))(logits, keys)
        return Choice(*(jax.sharding.reshard(x, P(split)) for x in chosen))

    def _compile(
        self, rows: int, columns: int, length: int, how: Sampling, kind: str, ends: bool = True
    ) -> Any:
        """The program, compiled now (ahead of its first call): ``kind`` ``"prefill"``,
        ``"decode"`` (the loop; ``ends``: it stops once every row is done) or ``"whole"``
        (the two as one)."""
        layout, decoding = self.layout, self.decoding
        with jax.set_mesh(self.plan.mesh):
            abstract_cache = self._abstract_cache(rows, length)
        cache_shardings = [layout.cache_sharding(x) for x in abstract_cache]
        tokens_sharding = layout.rows(None)
        batch_shardings = {"tokens": tokens_sharding}

        def prefill(leaves, tokens, positions, active, inputs):  # type: ignore[no-untyped-def]
            _, real, seed, row_ids, end_token = inputs
            with layout.tracing(batch_shardings):
                cache = decoding.new_cache(leaves, rows, length)
                cache, logits = decoding.prefill(leaves, cache, tokens, positions, real)
                first = self._choose(logits, seed, jnp.int32(0), row_ids, how)
                # [rows, length] buffers laid out as the rows (broadcast from a row's value).
                out = Choice(*(
                    jnp.zeros_like(x)[:, None] + jnp.zeros((1, length), x.dtype) for x in first
                ))  # fmt: skip
                out = Choice(*(o.at[:, 0].set(x) for o, x in zip(out, first, strict=True)))
                done = ~active | (first.token == end_token)
                taken = jnp.ones_like(first.token)
                return cache, Carry(jnp.int32(1), first.token, done, taken, out), inputs

        def decode(leaves, cache, carry, inputs, until):  # type: ignore[no-untyped-def]
            lengths, real, seed, row_ids, end_token = inputs

            def running(state: tuple[Any, Carry]) -> jax.Array:
                _, c = state
                return (c.step < until) & ~jnp.all(c.done) if ends else c.step < until

            def step(state: tuple[Any, Carry]) -> tuple[Any, Carry]:
                cache, c = state
                position = lengths + c.step - 1
                cache, logits = decoding.decode(leaves, cache, c.token, position, real)
                chosen = self._choose(logits, seed, c.step, row_ids, how)
                # Greedy writes the token and its log-probability only: the sampling
                # distribution's are the same and nothing is truncated (the host fills
                # them in, ``Sampler``), two [rows, length] writes a step saved.
                written = 2 if how.greedy else len(chosen)
                out = Choice(*(
                    jax.lax.dynamic_update_slice_in_dim(o, x[:, None], c.step, axis=1)
                    if i < written else o
                    for i, (o, x) in enumerate(zip(c.out, chosen, strict=True))
                ))  # fmt: skip
                taken = c.taken + (~c.done).astype(c.taken.dtype)
                done = c.done | (chosen.token == end_token)
                return cache, Carry(c.step + 1, chosen.token, done, taken, out)

            with layout.tracing(batch_shardings):
                return jax.lax.while_loop(running, step, (cache, carry))

        def whole(leaves, block, scalars):  # type: ignore[no-untyped-def]
            with layout.tracing(batch_shardings):
                tokens, positions, active, inputs, until = _from_host(
                    block, scalars, columns, length
                )
            cache, carry, inputs = prefill(leaves, tokens, positions, active, inputs)
            return pack(decode(leaves, cache, carry, inputs, until)[1], how.greedy)

        row = layout.rows()
        state = layout.abstract_state()
        scalar = {"sharding": self.plan.replicated}
        seed = jax.ShapeDtypeStruct((), jnp.uint32, **scalar)
        end_token = jax.ShapeDtypeStruct((), jnp.int32, **scalar)
        row_ids = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=row)
        real = jax.ShapeDtypeStruct((rows, length), jnp.bool_, sharding=tokens_sharding)
        buffer_shardings = Choice._make([tokens_sharding] * 4)
        carry_shardings = Carry._make((self.plan.replicated, row, row, row, buffer_shardings))
        column = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=row)
        inputs = Inputs._make((column, real, seed, row_ids, end_token))
        inputs_shardings = Inputs._make([x.sharding for x in inputs])
        program: Callable[..., Any]
        args: tuple[Any, ...]
        donate: tuple[int, ...]
        step = jax.ShapeDtypeStruct((), jnp.int32, **scalar)
        if kind != "decode":
            block = jax.ShapeDtypeStruct((rows, columns), jnp.int32, sharding=tokens_sharding)
            active = jax.ShapeDtypeStruct((rows,), jnp.bool_, sharding=row)
            args = (state, block, block, active, inputs)
            out_shardings: Any = (cache_shardings, carry_shardings, inputs_shardings)
            program, donate = prefill, ()
            if kind == "whole":
                width = 2 * columns + length + 3
                block = jax.ShapeDtypeStruct((rows, width), jnp.int32, sharding=tokens_sharding)
                scalars = jax.ShapeDtypeStruct((3,), jnp.int32, **scalar)
                program, args, out_shardings = whole, (state, block, scalars), tokens_sharding
        else:
            cache = [
                jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
                for x, s in zip(abstract_cache, cache_shardings, strict=True)
            ]
            buffers = [
                jax.ShapeDtypeStruct((rows, length), d, sharding=tokens_sharding)
                for d in (jnp.int32, jnp.float32, jnp.float32, jnp.float32)
            ]
            done = jax.ShapeDtypeStruct((rows,), jnp.bool_, sharding=row)
            carry = Carry._make((step, column, done, column, Choice._make(buffers)))
            program, donate = decode, (1,)
            args = (state, cache, carry, inputs, step)
            out_shardings = (cache_shardings, carry_shardings)
        with jax.set_mesh(self.plan.mesh):
            jitted = self.plan.compile_program(
                program,
                in_shardings=jax.tree.map(lambda x: x.sharding, args),
                out_shardings=out_shardings,
                donate_argnums=donate,
            )
            lower = getattr(jitted, "lower", None)  # a strategy's own wrapper may not lower
            return jitted if lower is None else lower(*args).compile()
