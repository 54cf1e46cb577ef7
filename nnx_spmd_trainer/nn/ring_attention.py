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

Blocks on cuDNN (``block_implementation``): on a GPU with bf16/fp16 inputs and a
head dim cuDNN's flash kernel takes, each block of the forward ring is one call
of cuDNN's fused attention returning its output and float32 log-sum-exp
(``adapters.jax_private.cudnn_attention``: the public
``jax.nn.dot_product_attention(..., implementation="cudnn", return_residual=True)``
casts that log-sum-exp to bf16, too coarse to merge by), and the blocks are
merged by their log-sum-exps. Packed rows go to cuDNN too: the segment mask as
``mask=`` (cuDNN adds it as a bias), the causal mask of a diagonal block as its
own mask type. The backward ring keeps the einsum blocks (fp32 scores, given the
merged log-sum-exp). Elsewhere (the CPU, fp32) every block is the einsum form,
the exact reference; ``blocks="xla"`` runs the merge of the cuDNN path with
``jax.nn.dot_product_attention``'s XLA blocks, so it is tested where cuDNN is absent.

Packed rows (``segment_ids``): each key/value chunk travels with its segment
ids, every block masks a query from the keys of other segments, and a block
whose query and key half-chunks hold no segment in common in any row (their
ranges of ids do not overlap) is skipped like a block above the diagonal.
``ring_schedule`` gives, for concrete segment ids, the kind of every block the
ring visits, by the same rule (``_kind``) the ring applies while it runs.
Padding (segment 0) is renumbered past every document, so a row packed left to
right keeps non-decreasing ids and padding blocks meet only padding.
"""

from __future__ import annotations

import functools
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from nnx_spmd_trainer.adapters import jax_private

__all__ = [
    "BLOCKS",
    "SKIP",
    "block_implementation",
    "ring_attention",
    "ring_blocks",
    "ring_schedule",
]

_SKIP, _DIAGONAL, _FULL = 0, 1, 2
#: ``ring_schedule``'s mark of a block never computed.
SKIP = _SKIP
# A finite mask value: a row masked whole in a block visited before its own diagonal
# gives finite garbage that the later rescale (exp(-1e30 - m) = 0) wipes out, not NaN.
_MASKED = -1e30


#: How ring attention computes a block: fp32 einsums (the reference, everywhere), cuDNN's
#: fused kernel (a GPU), or ``jax.nn.dot_product_attention``'s XLA form merged as cuDNN's is.
BLOCKS = ("einsum", "cudnn", "xla")
#: The largest head dim ``block_implementation`` gives cuDNN (its flash kernel's limit
#: before Hopper; Hopper takes 256).
CUDNN_MAX_HEAD_DIM = 128


class _Ring(NamedTuple):
    axis: str
    size: int
    balanced: bool
    blocks: str = "einsum"
    segmented: bool = False  # segment ids given: the fused blocks take the segment mask


def block_implementation(
    dtype: Any, head_dim: int, block_length: int, *, backend: str | None = None
) -> Literal["cudnn", "einsum"]:
    """How ring attention computes its blocks by default: ``"cudnn"`` (cuDNN's fused
    kernel) on a GPU for bf16/fp16 inputs whose head dim is a multiple of 8 up to
    ``CUDNN_MAX_HEAD_DIM`` and whose half-chunks (``block_length`` tokens) are even, when
    JAX still offers the kernel with its float32 log-sum-exp; ``"einsum"`` otherwise
    (the CPU, fp32: cuDNN refuses fp32). ``backend``: ``jax.default_backend()`` if None.

    >>> block_implementation(jnp.bfloat16, 64, 512, backend="gpu")
    'cudnn'
    >>> block_implementation(jnp.float32, 64, 512, backend="gpu")
    'einsum'
    >>> block_implementation(jnp.bfloat16, 64, 512, backend="cpu")
    'einsum'
    """
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    shape_ok = head_dim % 8 == 0 and head_dim <= CUDNN_MAX_HEAD_DIM and block_length % 2 == 0
    on_gpu = (backend or jax.default_backend()) == "gpu"
    if half and shape_ok and on_gpu and jax_private.cudnn_attention() is not None:
        return "cudnn"
    return "einsum"


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


def _kind(q_id: jax.Array, k_id: jax.Array, q_seg: jax.Array, k_seg: jax.Array) -> jax.Array:
    """The block of query half-chunk ``q_id`` against key half-chunk ``k_id`` (their segment
    ids ``[b, t]``): skipped above the diagonal or where no row's segment ranges overlap
    (no query can share a segment with a key), causal on the diagonal, full below it."""
    meets = jnp.any((k_seg.max(1) >= q_seg.min(1)) & (k_seg.min(1) <= q_seg.max(1)))
    return jnp.where((k_id > q_id) | ~meets, _SKIP, jnp.where(k_id == q_id, _DIAGONAL, _FULL))


def _scores(q, k, q_seg, k_seg, diagonal: bool):  # type: ignore[no-untyped-def]
    """fp32 scores ``[b, h, q, k]``, keys of other segments masked, and the causal mask on a
    diagonal block."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    s = s / np.sqrt(q.shape[-1]).astype(np.float32)
    keep = q_seg[:, None, :, None] == k_seg[:, None, None, :]
    if diagonal:
        t = q.shape[1]
        keep = keep & jnp.tril(jnp.ones((t, t), bool))
    return jnp.where(keep, s, _MASKED)


# -- forward ---------------------------------------------------------------------------
def _accumulate(state, q, k, v, q_seg, k_seg, kind):  # type: ignore[no-untyped-def]
    """One block of the online softmax: ``state = (out, max, denominator)``, fp32."""

    def block(diagonal: bool):  # type: ignore[no-untyped-def]
        def run(state):  # type: ignore[no-untyped-def]
            out, m, denominator = state
            s = _scores(q, k, q_seg, k_seg, diagonal)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            rescale = jnp.exp(m - m_new)
            pv = jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(jnp.float32))
            out = out * jnp.swapaxes(rescale, 1, 2)[..., None] + pv
            return out, m_new, denominator * rescale + p.sum(-1)

        return run

    return lax.switch(kind, [lambda state: state, block(True), block(False)], state)


def _fused(ring: _Ring, q, k, v, q_seg, k_seg, diagonal: bool):  # type: ignore[no-untyped-def]
    """One block by a fused kernel: (output, fp32 log-sum-exp ``[b, h, q]``)."""
    mask = None
    if ring.segmented:  # True to keep: a query sees the keys of its own segment
        mask = q_seg[:, None, :, None] == k_seg[:, None, None, :]
    if ring.blocks == "cudnn":
        attend = jax_private.cudnn_attention()
        assert attend is not None  # block_implementation chose cudnn only where it is
        return attend(q, k, v, mask, causal=diagonal)
    out, lse = jax.nn.dot_product_attention(
        q, k, v, mask=mask, is_causal=diagonal, implementation="xla", return_residual=True
    )
    return out, jnp.swapaxes(lse, 1, 2).astype(jnp.float32)


def _merge(ring: _Ring, state, q, k, v, q_seg, k_seg, kind):  # type: ignore[no-untyped-def]
    """One fused block merged into ``state = (out, lse)`` (fp32) by the log-sum-exps: a
    row masked whole in a block has a finite lse near the kernel's mask value, so a real
    block's weight wipes it out (no NaN)."""

    def block(diagonal: bool):  # type: ignore[no-untyped-def]
        def run(state):  # type: ignore[no-untyped-def]
            out, lse = state
            out_b, lse_b = _fused(ring, q, k, v, q_seg, k_seg, diagonal)
            new = jnp.logaddexp(lse, lse_b)
            keep, add = (jnp.swapaxes(jnp.exp(x - new), 1, 2)[..., None] for x in (lse, lse_b))
            return out * keep + out_b.astype(jnp.float32) * add, new

        return run

    return lax.switch(kind, [lambda state: state, block(True), block(False)], state)


def _fresh(ring: _Ring, b: int, t: int, h: int, d: int) -> tuple[jax.Array, ...]:
    """The empty state of a query half-chunk: (out, max, denominator) for the einsum
    blocks, (out, lse) for the fused ones."""
    out, low = jnp.zeros((b, t, h, d), jnp.float32), jnp.full((b, h, t), -jnp.inf, jnp.float32)
    if ring.blocks == "einsum":
        return out, low, jnp.zeros((b, h, t), jnp.float32)
    return out, low


def _finished(ring: _Ring, state) -> tuple[jax.Array, jax.Array]:  # type: ignore[no-untyped-def]
    """A half-chunk's (output, log-sum-exp) from its state."""
    if ring.blocks == "einsum":
        out, m, den = state
        return out / jnp.swapaxes(den, 1, 2)[..., None], m + jnp.log(den)
    return state


def _shift(ring: _Ring, *xs: jax.Array) -> tuple[jax.Array, ...]:
    """Every array one hop along the ring: device ``i`` receives device ``i-1``'s."""
    perm = [(i, (i + 1) % ring.size) for i in range(ring.size)]
    return tuple(lax.ppermute(x, ring.axis, perm) for x in xs)


def _forward(ring: _Ring, q, k, v, seg):  # type: ignore[no-untyped-def]
    me = lax.axis_index(ring.axis)
    q_ids, qs, q_segs = _chunk_ids(ring, me), _halves(q), _halves(seg)
    fresh = _fresh(ring, *qs[0].shape)

    def visit(states, k, v, k_seg, owner):  # type: ignore[no-untyped-def]
        k_ids, ks, vs, k_segs = _chunk_ids(ring, owner), _halves(k), _halves(v), _halves(k_seg)

        def block(st, i, j):  # type: ignore[no-untyped-def]
            kind = _kind(q_ids[i], k_ids[j], q_segs[i], k_segs[j])
            if ring.blocks == "einsum":
                return _accumulate(st, qs[i], ks[j], vs[j], q_segs[i], k_segs[j], kind)
            return _merge(ring, st, qs[i], ks[j], vs[j], q_segs[i], k_segs[j], kind)

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
    outs, lses = zip(*(_finished(ring, st) for st in states), strict=True)
    return jnp.concatenate(outs, axis=1).astype(q.dtype), jnp.concatenate(lses, axis=-1)


# -- backward --------------------------------------------------------------------------
def _block_grads(q, k, v, q_seg, k_seg, do, lse, delta, kind):  # type: ignore[no-untyped-def]
    """(dq, dk, dv) of one block, fp32; zeros for a skipped one."""

    def block(diagonal: bool):  # type: ignore[no-untyped-def]
        def run(_):  # type: ignore[no-untyped-def]
            p = jnp.exp(_scores(q, k, q_seg, k_seg, diagonal) - lse[..., None])
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


def _backward(ring: _Ring, q, k, v, seg, out, lse, do):  # type: ignore[no-untyped-def]
    me = lax.axis_index(ring.axis)
    do32 = do.astype(jnp.float32)
    # delta = rowsum(dO * O): the softmax's backward term, per query row, [b, h, q].
    delta = jnp.swapaxes(jnp.sum(do32 * out.astype(jnp.float32), -1), 1, 2)
    q_ids, qs, dos, q_segs = _chunk_ids(ring, me), _halves(q), _halves(do32), _halves(seg)
    t = qs[0].shape[1]
    lses, deltas = (lse[..., :t], lse[..., t:]), (delta[..., :t], delta[..., t:])

    def step(carry, s):  # type: ignore[no-untyped-def]
        dq, k, v, k_seg, dk, dv = carry
        k_ids, ks, vs = _chunk_ids(ring, (me - s) % ring.size), _halves(k), _halves(v)
        k_segs = _halves(k_seg)
        dqs, dks, dvs = list(_halves(dq)), list(_halves(dk)), list(_halves(dv))
        for i in (0, 1):
            for j in (0, 1):
                kind = _kind(q_ids[i], k_ids[j], q_segs[i], k_segs[j])
                g = _block_grads(
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
def _ring_local(ring: _Ring, q, k, v, seg):  # type: ignore[no-untyped-def]
    return _forward(ring, q, k, v, seg)[0]


def _ring_local_fwd(ring: _Ring, q, k, v, seg):  # type: ignore[no-untyped-def]
    out, lse = _forward(ring, q, k, v, seg)
    return out, (q, k, v, seg, out, lse)


def _ring_local_bwd(ring: _Ring, residuals, do):  # type: ignore[no-untyped-def]
    q, k, v, seg, out, lse = residuals
    return (*_backward(ring, q, k, v, seg, out, lse, do), None)  # no cotangent for ids


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
    ring = _Ring(axis, size, balanced, blocks, segment_ids is not None)
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
    causal mask) or 2 (full), by the rule the ring itself applies (``_kind``).

    >>> one, two = np.ones((1, 16), int), np.repeat([[1, 2]], 8, axis=1)
    >>> int((ring_schedule(one, 4) == SKIP).sum()), int((ring_schedule(two, 4) == SKIP).sum())
    (28, 44)
    """
    ring = _Ring("ring", size, balanced)
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
                    kinds[device, step, i, j] = int(_kind(q_ids[i], k_ids[j], q_seg, k_seg))
    return kinds
