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

Blocks (``ring_blocks``): each block's kind, its share of the softmax, its gradient,
and how it is computed: fp32 einsums, or on a GPU in bf16/fp16 cuDNN's fused kernel
(``ring_blocks.block_implementation``). This module is the ring that visits them: which
half-chunks a device holds, the hops, the custom VJP and the balanced order.

Packed rows (``segment_ids``): each key/value chunk travels with its segment
ids, every block masks a query from the keys of other segments, and a block
whose query and key half-chunks hold no segment in common in any row (their
ranges of ids do not overlap) is skipped like a block above the diagonal.
``ring_schedule`` gives, for concrete segment ids, the kind of every block the
ring visits, by the same rule (``ring_blocks.block_kind``) the ring applies while it runs.
Padding (segment 0) is renumbered past every document, so a row packed left to
right keeps non-decreasing ids and padding blocks meet only padding.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from nnx_spmd_trainer.nn.ring_blocks import (
    BLOCKS,
    SKIP,
    Ring,
    add_block,
    block_grads,
    block_implementation,
    block_kind,
    finished,
    fresh_state,
    halves,
)

__all__ = [
    "BLOCKS",
    "SKIP",
    "block_implementation",
    "ring_attention",
    "ring_blocks",
    "ring_schedule",
]


def _chunk_ids(ring: Ring, device: jax.Array) -> jax.Array:
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


# -- forward ---------------------------------------------------------------------------
def _shift(ring: Ring, *xs: jax.Array) -> tuple[jax.Array, ...]:
    """Every array one hop along the ring: device ``i`` receives device ``i-1``'s."""
    perm = [(i, (i + 1) % ring.size) for i in range(ring.size)]
    return tuple(lax.ppermute(x, ring.axis, perm) for x in xs)


def _forward(ring: Ring, q, k, v, seg):  # type: ignore[no-untyped-def]
    me = lax.axis_index(ring.axis)
    q_ids, qs, q_segs = _chunk_ids(ring, me), halves(q), halves(seg)
    fresh = fresh_state(ring, *qs[0].shape)

    def visit(states, k, v, k_seg, owner):  # type: ignore[no-untyped-def]
        k_ids, ks, vs, k_segs = _chunk_ids(ring, owner), halves(k), halves(v), halves(k_seg)

        def block(st, i, j):  # type: ignore[no-untyped-def]
            kind = block_kind(q_ids[i], k_ids[j], q_segs[i], k_segs[j])
            return add_block(ring, st, qs[i], ks[j], vs[j], q_segs[i], k_segs[j], kind)

        return tuple(
            functools.reduce(lambda st, j, i=i: block(st, i, j), (0, 1), states[i]) for i in (0, 1)
        )

    def step(carry, s):  # type: ignore[no-untyped-def]
        states, k, v, k_seg = carry
        k, v, k_seg = _shift(ring, k, v, k_seg)
        return (visit(states, k, v, k_seg, (me - s) % ring.size), k, v, k_seg), None

    states = visit((fresh, fresh), k, v, seg, me)  # the local block first: no hop
    carry: Any = (states, k, v, seg)
    (states, *_), _ = lax.scan(step, carry, jnp.arange(1, ring.size))
    outs, lses = zip(*(finished(ring, st) for st in states), strict=True)
    return jnp.concatenate(outs, axis=1).astype(q.dtype), jnp.concatenate(lses, axis=-1)


# -- backward --------------------------------------------------------------------------
def _backward(ring: Ring, q, k, v, seg, out, lse, do):  # type: ignore[no-untyped-def]
    me = lax.axis_index(ring.axis)
    do32 = do.astype(jnp.float32)
    # delta = rowsum(dO * O): the softmax's backward term, per query row, [b, h, q].
    delta = jnp.swapaxes(jnp.sum(do32 * out.astype(jnp.float32), -1), 1, 2)
    q_ids, qs, dos, q_segs = _chunk_ids(ring, me), halves(q), halves(do32), halves(seg)
    t = qs[0].shape[1]
    lses, deltas = (lse[..., :t], lse[..., t:]), (delta[..., :t], delta[..., t:])

    def step(carry, s):  # type: ignore[no-untyped-def]
        dq, k, v, k_seg, dk, dv = carry
        k_ids, ks, vs = _chunk_ids(ring, (me - s) % ring.size), halves(k), halves(v)
        k_segs = halves(k_seg)
        dqs, dks, dvs = list(halves(dq)), list(halves(dk)), list(halves(dv))
        for i in (0, 1):
            for j in (0, 1):
                kind = block_kind(q_ids[i], k_ids[j], q_segs[i], k_segs[j])
                g = block_grads(
                    qs[i], ks[j], vs[j], q_segs[i], k_segs[j], dos[i], lses[i], deltas[i], kind
                )
                dqs[i], dks[j], dvs[j] = dqs[i] + g[0], dks[j] + g[1], dvs[j] + g[2]
        dq = jnp.concatenate(dqs, axis=1)
        # The gradients travel with their key/value chunk: after N hops all are home.
        dks, dvs = jnp.concatenate(dks, 1), jnp.concatenate(dvs, 1)
        k, v, k_seg, dk, dv = _shift(ring, k, v, k_seg, dks, dvs)
        return (dq, k, v, k_seg, dk, dv), None

    zeros = jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32)
    carry = (zeros[0], k, v, seg, zeros[1], zeros[1])
    (dq, _, _, _, dk, dv), _ = lax.scan(step, carry, jnp.arange(ring.size))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring_local(ring: Ring, q, k, v, seg):  # type: ignore[no-untyped-def]
    return _forward(ring, q, k, v, seg)[0]


def _ring_local_fwd(ring: Ring, q, k, v, seg):  # type: ignore[no-untyped-def]
    out, lse = _forward(ring, q, k, v, seg)
    return out, (q, k, v, seg, out, lse)


def _ring_local_bwd(ring: Ring, residuals, do):  # type: ignore[no-untyped-def]
    q, k, v, seg, out, lse = residuals
    return (*_backward(ring, q, k, v, seg, out, lse, do), None)  # no cotangent for ids


_ring_local.defvjp(_ring_local_fwd, _ring_local_bwd)


# -- the balanced order: two permutes of half-chunks ----------------------------------
def _home(n: int, chunk: int) -> int:
    """The device holding half-chunk ``chunk`` in the balanced order."""
    return chunk if chunk < n else 2 * n - 1 - chunk


def _to_balanced(ring: Ring, x: jax.Array) -> jax.Array:
    """Device ``i``'s contiguous half-chunks ``(2i, 2i+1)`` -> balanced ``(i, 2N-1-i)``.

    Each parity of half-chunk is a permutation of the devices (of ``c`` and
    ``2N-1-c`` exactly one is even), so two ``ppermute``s carry them; a device
    of even index gets its front chunk from the even permute, an odd one from
    the odd permute.
    """
    n, (first, second) = ring.size, halves(x)
    even = lax.ppermute(first, ring.axis, [(i, _home(n, 2 * i)) for i in range(n)])
    odd = lax.ppermute(second, ring.axis, [(i, _home(n, 2 * i + 1)) for i in range(n)])
    me_even = lax.axis_index(ring.axis) % 2 == 0
    return jnp.concatenate([jnp.where(me_even, even, odd), jnp.where(me_even, odd, even)], axis=1)


def _from_balanced(ring: Ring, x: jax.Array) -> jax.Array:
    """The inverse of ``_to_balanced``."""
    n, (front, back) = ring.size, halves(x)
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
    segment_ids: jax.Array | None = None,
    blocks: str | None = None,
) -> jax.Array:
    """Exact causal attention over ``[batch, seq, heads, head_dim]`` arrays whose
    sequence is split over mesh axis ``axis`` of the current mesh (``jax.set_mesh``).

    A ``jax.shard_map`` manual only over ``axis``: the batch and heads keep
    whatever layout the other mesh axes give them (data, FSDP, a ``model``
    axis), left to the compiler. The local sequence chunk must be even (two
    half-chunks per device). Call it while tracing under a mesh that has
    ``axis``; ``causal_attention`` calls it under ``SequenceParallel(...,
    attention="ring")``. ``segment_ids`` (``[batch, seq]``, 0 = padding): each
    query attends to its own segment's keys only; blocks no segment spans are skipped.
    ``blocks``: how each block is computed (``BLOCKS``); None: ``block_implementation``.
    """
    mesh = jax.sharding.get_abstract_mesh()
    size = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))[axis]
    if query.shape[1] % (2 * size):
        raise ValueError(
            f"ring attention splits the sequence into 2 x {size} half-chunks over mesh "
            f"axis {axis!r}; a sequence of length {query.shape[1]} is not divisible by "
            f"{2 * size}. Pad the sequence, or use attention='all_gather'."
        )
    if blocks is None:
        blocks = block_implementation(query.dtype, query.shape[-1], query.shape[1] // (2 * size))
    if blocks not in BLOCKS:
        raise ValueError(f"ring_attention(blocks={blocks!r}): choose one of {BLOCKS} or None")
    ring = Ring(axis, size, balanced, blocks, segment_ids is not None)
    spec = P(None, axis)
    segments = _renumbered(query.shape[:2] if segment_ids is None else segment_ids)

    def local(q, k, v, seg):  # type: ignore[no-untyped-def]
        if ring.balanced:
            q, k, v, seg = (_to_balanced(ring, x) for x in (q, k, v, seg))
        out = _ring_local(ring, q, k, v, seg)
        return _from_balanced(ring, out) if ring.balanced else out

    sharded = jax.shard_map(
        local, in_specs=(spec,) * 4, out_specs=spec, axis_names={axis}, check_vma=False
    )
    return sharded(query, key, value, segments)


def _renumbered(segment_ids: jax.Array | tuple[int, ...]) -> jax.Array:
    """int32 segment ids with padding (0) after every document; one segment for a shape."""
    if isinstance(segment_ids, tuple):
        return jnp.ones(segment_ids, jnp.int32)
    ids = jnp.asarray(segment_ids).astype(jnp.int32)
    return jnp.where(ids == 0, jnp.iinfo(jnp.int32).max, ids)


def ring_schedule(segment_ids: np.ndarray, size: int, balanced: bool = True) -> np.ndarray:
    """What the ring does with each block for these segment ids (``[batch, seq]``, concrete):
    ``[device, step, query half, key half]`` of ``SKIP`` (never computed), 1 (diagonal,
    causal mask) or 2 (full), by the rule the ring itself applies (``block_kind``).

    >>> one, two = np.ones((1, 16), int), np.repeat([[1, 2]], 8, axis=1)
    >>> int((ring_schedule(one, 4) == SKIP).sum()), int((ring_schedule(two, 4) == SKIP).sum())
    (28, 44)
    """
    ring = Ring("ring", size, balanced)
    chunks = _renumbered(jnp.asarray(segment_ids))
    chunks = chunks.reshape(chunks.shape[0], 2 * size, -1)
    kinds = np.zeros((size, size, 2, 2), np.int32)
    for device in range(size):
        q_ids = _chunk_ids(ring, jnp.asarray(device))
        for step in range(size):
            k_ids = _chunk_ids(ring, jnp.asarray((device - step) % size))
            for i in (0, 1):
                for j in (0, 1):
                    q_seg, k_seg = chunks[:, int(q_ids[i])], chunks[:, int(k_ids[j])]
                    kinds[device, step, i, j] = int(block_kind(q_ids[i], k_ids[j], q_seg, k_seg))
    return kinds
