"""One block of ring attention: a query half-chunk against a key half-chunk, its kind, its
share of the softmax and its gradient. ``ring_attention`` runs the ring that visits them.

Kinds (``block_kind``): a block above the causal diagonal, or one whose query and key
half-chunks hold no segment in common in any row, is skipped (``SKIP``: ``lax.switch``
computes no scores); the diagonal block gets the causal mask (``DIAGONAL``), a block
below it none (``FULL``).

Forward (``fresh_state``, ``add_block``, ``finished``): the softmax is accumulated block
by block, with the running max and denominator in fp32 (the online softmax of flash
attention), so the result equals one device's. Backward (``block_grads``): one block's
``dq``, ``dk``, ``dv`` in fp32, given the merged log-sum-exp.

How a forward block is computed (``BLOCKS``, chosen by ``block_implementation``): on a GPU
with bf16/fp16 inputs and a head dim cuDNN's flash kernel takes, each block is one call of
cuDNN's fused attention returning its output and float32 log-sum-exp
(``adapters.jax_private.cudnn_attention``: the public
``jax.nn.dot_product_attention(..., implementation="cudnn", return_residual=True)``
casts that log-sum-exp to bf16, too coarse to merge by), and the blocks are merged by
their log-sum-exps. Packed rows go to cuDNN too: the segment mask as ``mask=`` (cuDNN
adds it as a bias), the causal mask of a diagonal block as its own mask type. The
backward keeps the einsum blocks (fp32 scores). Elsewhere (the CPU, fp32) every block is
the einsum form, the exact reference; ``blocks="xla"`` runs the merge of the cuDNN path
with ``jax.nn.dot_product_attention``'s XLA blocks, so it is tested where cuDNN is absent.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from nnx_spmd_trainer.adapters import jax_private

__all__ = [
    "BLOCKS",
    "CUDNN_MAX_HEAD_DIM",
    "DIAGONAL",
    "FULL",
    "SKIP",
    "Ring",
    "add_block",
    "block_grads",
    "block_implementation",
    "block_kind",
    "finished",
    "fresh_state",
    "halves",
]

#: A block's kind: never computed, causal mask (the diagonal), no mask (below it).
SKIP, DIAGONAL, FULL = 0, 1, 2
# A finite mask value: a row masked whole in a block visited before its own diagonal
# gives finite garbage that the later rescale (exp(-1e30 - m) = 0) wipes out, not NaN.
_MASKED = -1e30


#: How ring attention computes a block: fp32 einsums (the reference, everywhere), cuDNN's
#: fused kernel (a GPU), or ``jax.nn.dot_product_attention``'s XLA form merged as cuDNN's is.
BLOCKS = ("einsum", "cudnn", "xla")
#: The largest head dim ``block_implementation`` gives cuDNN (its flash kernel's limit
#: before Hopper; Hopper takes 256).
CUDNN_MAX_HEAD_DIM = 128


class Ring(NamedTuple):
    """One ring attention call: the mesh axis and its size, the order of the half-chunks,
    how its blocks are computed (``BLOCKS``) and whether segment ids were given."""

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


def halves(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A device's chunk ``[b, t, ...]`` as its two half-chunks along the sequence."""
    half = x.shape[1] // 2
    return x[:, :half], x[:, half:]


def block_kind(q_id: jax.Array, k_id: jax.Array, q_seg: jax.Array, k_seg: jax.Array) -> jax.Array:
    """The block of query half-chunk ``q_id`` against key half-chunk ``k_id`` (their segment
    ids ``[b, t]``): skipped above the diagonal or where no row's segment ranges overlap
    (no query can share a segment with a key), causal on the diagonal, full below it."""
    meets = jnp.any((k_seg.max(1) >= q_seg.min(1)) & (k_seg.min(1) <= q_seg.max(1)))
    return jnp.where((k_id > q_id) | ~meets, SKIP, jnp.where(k_id == q_id, DIAGONAL, FULL))


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


def _fused(ring: Ring, q, k, v, q_seg, k_seg, diagonal: bool):  # type: ignore[no-untyped-def]
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


def _merge(ring: Ring, state, q, k, v, q_seg, k_seg, kind):  # type: ignore[no-untyped-def]
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


def add_block(ring: Ring, state, q, k, v, q_seg, k_seg, kind):  # type: ignore[no-untyped-def]
    """``state`` (``fresh_state``'s form) with one block of kind ``kind`` added: the online
    softmax of the einsum blocks, or a fused block merged by its log-sum-exp."""
    if ring.blocks == "einsum":
        return _accumulate(state, q, k, v, q_seg, k_seg, kind)
    return _merge(ring, state, q, k, v, q_seg, k_seg, kind)


def fresh_state(ring: Ring, b: int, t: int, h: int, d: int) -> tuple[jax.Array, ...]:
    """The empty state of a query half-chunk: (out, max, denominator) for the einsum
    blocks, (out, lse) for the fused ones."""
    out, low = jnp.zeros((b, t, h, d), jnp.float32), jnp.full((b, h, t), -jnp.inf, jnp.float32)
    if ring.blocks == "einsum":
        return out, low, jnp.zeros((b, h, t), jnp.float32)
    return out, low


def finished(ring: Ring, state) -> tuple[jax.Array, jax.Array]:  # type: ignore[no-untyped-def]
    """A half-chunk's (output, log-sum-exp) from its state."""
    if ring.blocks == "einsum":
        out, m, den = state
        return out / jnp.swapaxes(den, 1, 2)[..., None], m + jnp.log(den)
    return state


# -- backward --------------------------------------------------------------------------
def block_grads(q, k, v, q_seg, k_seg, do, lse, delta, kind):  # type: ignore[no-untyped-def]
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
