"""Causal ring attention: keys and values passed around the sequence axis a block at a time.

The all-gather form (``attention.causal_attention``) gives every device the
whole sequence's keys and values. Here each device keeps its own chunk of
queries, keys and values (``O(T/N)``) and the key/value chunks travel round
the ring (``lax.ppermute``), one hop per step, ``N`` steps; the softmax is
accumulated blockwise (running max and denominator in fp32, the online
softmax of flash attention), so the result equals one device's.

Blocks: every device's chunk is two half-chunks. Block pairs (query
half-chunk ``a``, key half-chunk ``b``) with ``b > a`` lie entirely above the
causal diagonal and are skipped (``lax.switch``: no scores computed), ``b ==
a`` gets the causal mask, ``b < a`` none. With the **balanced** order
(default) device ``i`` holds half-chunks ``i`` and ``2N-1-i`` of the sequence
(one from the front, one from the back), so every device computes ``2N+1``
blocks: the causal work is even. The contiguous order (device ``i`` holds
``2i`` and ``2i+1``) leaves device 0 with 3 blocks and device ``N-1`` with
``4N-1``. Arrays arrive and leave in the contiguous layout the rest of the
model uses (positions stay global); the balanced reorder is two
collective-permutes of half-chunks on the way in (queries, keys, values)
and two on the way out, done inside the attention so neither the batch nor
the model changes.

Gradient: a ``jax.custom_vjp``. Differentiating the scan over ring steps
would also give a ring (``ppermute``'s transpose is the reverse ``ppermute``)
but would save every step's key/value block as a residual, ``O(T)`` per
device again: the memory the ring is for. The backward instead keeps only the
local queries, keys, values, output and log-sum-exp and runs a second ring,
in which the key/value chunks travel with their gradient accumulators and
are home after ``N`` hops.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

__all__ = ["ring_attention", "ring_blocks"]

_SKIP, _DIAGONAL, _FULL = 0, 1, 2


class _Ring(NamedTuple):
    axis: str
    size: int
    balanced: bool


def _chunk_ids(ring: _Ring, device: jax.Array) -> jax.Array:
    """The two global half-chunk indices device ``device`` holds."""
    n = ring.size
    if ring.balanced:
        return jnp.stack([device, 2 * n - 1 - device])
    return jnp.stack([2 * device, 2 * device + 1])


def ring_blocks(size: int, balanced: bool = True) -> list[int]:
    """The (half-chunk x half-chunk) score blocks each device computes over a whole ring:
    the causal work per device, ``size`` devices.

    >>> ring_blocks(4), ring_blocks(4, balanced=False)
    ([9, 9, 9, 9], [3, 7, 11, 15])
    """

    def ids(d: int) -> tuple[int, int]:
        return (d, 2 * size - 1 - d) if balanced else (2 * d, 2 * d + 1)

    return [
        sum(kc <= qc for qc in ids(d) for owner in range(size) for kc in ids(owner))
        for d in range(size)
    ]


def _halves(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    half = x.shape[1] // 2
    return x[:, :half], x[:, half:]


def _kind(q_id: jax.Array, k_id: jax.Array) -> jax.Array:
    return jnp.where(k_id > q_id, _SKIP, jnp.where(k_id == q_id, _DIAGONAL, _FULL))


def _scores(q: jax.Array, k: jax.Array, diagonal: bool) -> jax.Array:
    """fp32 scores ``[b, h, q, k]``, the causal mask applied on a diagonal block."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    s = s / np.sqrt(q.shape[-1]).astype(np.float32)
    if diagonal:
        t = q.shape[1]
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
    return s


# -- forward ---------------------------------------------------------------------------
def _accumulate(state, q, k, v, kind):  # type: ignore[no-untyped-def]
    """One block of the online softmax: ``state = (out, max, denominator)``, fp32."""

    def block(diagonal: bool):  # type: ignore[no-untyped-def]
        def run(state):  # type: ignore[no-untyped-def]
            out, m, denominator = state
            s = _scores(q, k, diagonal)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            rescale = jnp.exp(m - m_new)
            pv = jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(jnp.float32))
            out = out * jnp.swapaxes(rescale, 1, 2)[..., None] + pv
            return out, m_new, denominator * rescale + p.sum(-1)

        return run

    return lax.switch(kind, [lambda state: state, block(True), block(False)], state)


def _shift(ring: _Ring, *xs: jax.Array) -> tuple[jax.Array, ...]:
    """Every array one hop along the ring: device ``i`` receives device ``i-1``'s."""
    perm = [(i, (i + 1) % ring.size) for i in range(ring.size)]
    return tuple(lax.ppermute(x, ring.axis, perm) for x in xs)


def _forward(ring: _Ring, q, k, v):  # type: ignore[no-untyped-def]
    me = lax.axis_index(ring.axis)
    q_ids, qs = _chunk_ids(ring, me), _halves(q)
    b, t, h, d = qs[0].shape
    fresh = (
        jnp.zeros((b, t, h, d), jnp.float32),
        jnp.full((b, h, t), -jnp.inf, jnp.float32),
        jnp.zeros((b, h, t), jnp.float32),
    )

    def visit(states, k, v, owner):  # type: ignore[no-untyped-def]
        k_ids, ks, vs = _chunk_ids(ring, owner), _halves(k), _halves(v)
        return tuple(
            functools.reduce(
                lambda st, j: _accumulate(st, qs[i], ks[j], vs[j], _kind(q_ids[i], k_ids[j])),
                (0, 1),
                states[i],
            )
            for i in (0, 1)
        )

    def step(carry, s):  # type: ignore[no-untyped-def]
        states, k, v = carry
        k, v = _shift(ring, k, v)
        return (visit(states, k, v, (me - s) % ring.size), k, v), None

    states = visit((fresh, fresh), k, v, me)  # the local block first: no hop
    (states, _, _), _ = lax.scan(step, (states, k, v), jnp.arange(1, ring.size))
    outs = [o / jnp.swapaxes(den, 1, 2)[..., None] for o, _, den in states]
    lse = jnp.concatenate([m + jnp.log(den) for _, m, den in states], axis=-1)
    return jnp.concatenate(outs, axis=1).astype(q.dtype), lse


# -- backward --------------------------------------------------------------------------
def _block_grads(q, k, v, do, lse, delta, kind):  # type: ignore[no-untyped-def]
    """(dq, dk, dv) of one block, fp32; zeros for a skipped one."""

    def block(diagonal: bool):  # type: ignore[no-untyped-def]
        def run(_):  # type: ignore[no-untyped-def]
            p = jnp.exp(_scores(q, k, diagonal) - lse[..., None])
            dv = jnp.einsum("bhqk,bqhd->bkhd", p, do)
            dp = jnp.einsum("bqhd,bkhd->bhqk", do, v.astype(jnp.float32))
            ds = p * (dp - delta[..., None]) / np.sqrt(q.shape[-1]).astype(np.float32)
            dq = jnp.einsum("bhqk,bkhd->bqhd", ds, k.astype(jnp.float32))
            dk = jnp.einsum("bhqk,bqhd->bkhd", ds, q.astype(jnp.float32))
            return dq, dk, dv

        return run

    def skip(_):  # type: ignore[no-untyped-def]
        zq, zk = jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32)
        return zq, zk, zk

    return lax.switch(kind, [skip, block(True), block(False)], None)


def _backward(ring: _Ring, q, k, v, out, lse, do):  # type: ignore[no-untyped-def]
    me = lax.axis_index(ring.axis)
    do32 = do.astype(jnp.float32)
    # delta = rowsum(dO * O): the softmax's backward term, per query row, [b, h, q].
    delta = jnp.swapaxes(jnp.sum(do32 * out.astype(jnp.float32), -1), 1, 2)
    q_ids, qs, dos = _chunk_ids(ring, me), _halves(q), _halves(do32)
    t = qs[0].shape[1]
    lses, deltas = (lse[..., :t], lse[..., t:]), (delta[..., :t], delta[..., t:])

    def step(carry, s):  # type: ignore[no-untyped-def]
        dq, k, v, dk, dv = carry
        k_ids, ks, vs = _chunk_ids(ring, (me - s) % ring.size), _halves(k), _halves(v)
        dqs, dks, dvs = list(_halves(dq)), list(_halves(dk)), list(_halves(dv))
        for i in (0, 1):
            for j in (0, 1):
                g = _block_grads(
                    qs[i], ks[j], vs[j], dos[i], lses[i], deltas[i], _kind(q_ids[i], k_ids[j])
                )
                dqs[i], dks[j], dvs[j] = dqs[i] + g[0], dks[j] + g[1], dvs[j] + g[2]
        dq = jnp.concatenate(dqs, axis=1)
        # The gradients travel with their key/value chunk: after N hops all are home.
        k, v, dk, dv = _shift(ring, k, v, jnp.concatenate(dks, 1), jnp.concatenate(dvs, 1))
        return (dq, k, v, dk, dv), None

    zeros = jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32)
    carry = (zeros[0], k, v, zeros[1], zeros[1])
    (dq, _, _, dk, dv), _ = lax.scan(step, carry, jnp.arange(ring.size))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring_local(ring: _Ring, q, k, v):  # type: ignore[no-untyped-def]
    return _forward(ring, q, k, v)[0]


def _ring_local_fwd(ring: _Ring, q, k, v):  # type: ignore[no-untyped-def]
    out, lse = _forward(ring, q, k, v)
    return out, (q, k, v, out, lse)


def _ring_local_bwd(ring: _Ring, residuals, do):  # type: ignore[no-untyped-def]
    q, k, v, out, lse = residuals
    return _backward(ring, q, k, v, out, lse, do)


_ring_local.defvjp(_ring_local_fwd, _ring_local_bwd)


# -- the balanced order: two permutes of half-chunks ----------------------------------
def _home(n: int, chunk: int) -> int:
    """The device holding half-chunk ``chunk`` in the balanced order."""
    return chunk if chunk < n else 2 * n - 1 - chunk


def _to_balanced(ring: _Ring, x: jax.Array) -> jax.Array:
    """Device ``i``'s contiguous half-chunks ``(2i, 2i+1)`` -> balanced ``(i, 2N-1-i)``.

    Each parity of half-chunk is a permutation of the devices (of ``c`` and
    ``2N-1-c`` exactly one is even), so two ``ppermute``s carry them; a device
    of even index gets its front chunk from the even permute, an odd one from
    the odd permute.
    """
    n, (first, second) = ring.size, _halves(x)
    even = lax.ppermute(first, ring.axis, [(i, _home(n, 2 * i)) for i in range(n)])
    odd = lax.ppermute(second, ring.axis, [(i, _home(n, 2 * i + 1)) for i in range(n)])
    me_even = lax.axis_index(ring.axis) % 2 == 0
    return jnp.concatenate([jnp.where(me_even, even, odd), jnp.where(me_even, odd, even)], axis=1)


def _from_balanced(ring: _Ring, x: jax.Array) -> jax.Array:
    """The inverse of ``_to_balanced``."""
    n, (front, back) = ring.size, _halves(x)
    me_even = lax.axis_index(ring.axis) % 2 == 0
    even, odd = jnp.where(me_even, front, back), jnp.where(me_even, back, front)
    first = lax.ppermute(even, ring.axis, [(_home(n, 2 * i), i) for i in range(n)])
    second = lax.ppermute(odd, ring.axis, [(_home(n, 2 * i + 1), i) for i in range(n)])
    return jnp.concatenate([first, second], axis=1)


def ring_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    axis: str,
    *,
    balanced: bool = True,
) -> jax.Array:
    """Exact causal attention over ``[batch, seq, heads, head_dim]`` arrays whose
    sequence is split over mesh axis ``axis`` of the current mesh (``jax.set_mesh``).

    A ``jax.shard_map`` manual only over ``axis``: the batch and heads keep
    whatever layout the other mesh axes give them (data, FSDP, a ``model``
    axis), left to the compiler. The local sequence chunk must be even (two
    half-chunks per device). Call it while tracing under a mesh that has
    ``axis``; ``causal_attention`` calls it under ``SequenceParallel(...,
    attention="ring")``.
    """
    mesh = jax.sharding.get_abstract_mesh()
    ring = _Ring(axis, dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))[axis], balanced)
    if query.shape[1] % (2 * ring.size):
        raise ValueError(
            f"ring attention splits the sequence into 2 x {ring.size} half-chunks over mesh "
            f"axis {axis!r}; a sequence of length {query.shape[1]} is not divisible by "
            f"{2 * ring.size}. Pad the sequence, or use attention='all_gather'."
        )
    spec = P(None, axis)

    def local(q, k, v):  # type: ignore[no-untyped-def]
        if ring.balanced:
            q, k, v = (_to_balanced(ring, x) for x in (q, k, v))
        out = _ring_local(ring, q, k, v)
        return _from_balanced(ring, out) if ring.balanced else out

    sharded = jax.shard_map(
        local, in_specs=(spec, spec, spec), out_specs=spec, axis_names={axis}, check_vma=False
    )
    return sharded(query, key, value)
