"""Causal attention that stays exact when the sequence is split over devices.

``causal_attention`` is an ``attention_fn`` for ``nnx.MultiHeadAttention``.
Under ``SequenceParallel`` (whose ``trace_context`` maps the logical name
``length`` to its mesh axis) the queries stay split along the sequence and
the keys and values are gathered along it (the all-gather form of context
parallelism), so each device computes the scores of its own query positions
against every key: ``(seq / n) x seq`` per head, never the whole matrix.
The program is still written over global arrays (the sharding constraints
only guide the compiler), so positions, the causal mask and the result are
those of one device. With no ``length`` rule, or its axis absent from the
current mesh, it is ordinary causal attention. Inside ``attention_form("ring")``
(``SequenceParallel(..., attention="ring")`` enters it while tracing) the split
sequence takes ``ring_attention.ring_attention`` instead: no device ever holds
the whole sequence's keys and values.

Packed rows: ``segment_ids`` (``[batch, seq]`` integers, ``0`` for padding,
``1..k`` for the documents of a row) keep every document to itself in all three
forms: a query attends to the keys of its own segment only (and causally).
Padding attends to padding, so no row of the mask is empty and no output is NaN.
Positions restarting per document are the model's business (its position
embedding or rope), not the attention's.

Decoding (``nn.kv_cache``): a query shorter than its keys is a decode step's one
position against a cache; its causality is the cache's mask (Flax's
``MultiHeadAttention(decode=True)`` builds it).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Literal

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from nnx_spmd_trainer.nn import tracing
from nnx_spmd_trainer.nn.ring_attention import ring_attention

__all__ = [
    "FORMS",
    "attention_form",
    "attention_implementation",
    "causal_attention",
    "length_axes",
    "segment_mask",
]

#: The logical names of a sequence dimension, looked up in this order.
LENGTH_NAMES = ("length", "seq")
#: How ``causal_attention`` attends over a split sequence.
FORMS = ("all_gather", "ring")
# A context variable rather than a logical rule: the form is how to attend, not a layout.
_FORM: contextvars.ContextVar[str] = contextvars.ContextVar("attention_form", default=FORMS[0])


@contextlib.contextmanager
def attention_form(form: str) -> Iterator[None]:
    """Within it, ``causal_attention`` over a split sequence uses ``form``: ``"all_gather"``
    (keys and values gathered along the sequence axis, the default) or ``"ring"``
    (passed round it a block at a time, ``ring_attention``).

    >>> with attention_form("ring"):
    ...     _FORM.get()
    'ring'
    """
    if form not in FORMS:
        raise ValueError(f"attention form {form!r}: choose one of {FORMS}")
    token = _FORM.set(form)
    try:
        yield
    finally:
        _FORM.reset(token)


def attention_implementation(dtype: jnp.dtype) -> Literal["cudnn", "xla"]:
    """cuDNN's fused attention where it runs (a GPU, bf16/fp16 inputs: it refuses fp32),
    XLA's elsewhere."""
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return "cudnn" if half and jax.default_backend() == "gpu" else "xla"


def length_axes() -> tuple[str, ...]:
    """The mesh axes splitting the sequence while a step is traced: where the enclosing
    ``nnx.logical_axis_rules`` map ``length`` (else ``seq``), kept if the current mesh has
    them with more than one device; ``()`` when the sequence is not split.

    >>> length_axes()  # no rules, no mesh
    ()
    """
    return tracing.traced_axes(*LENGTH_NAMES)


def _pinned(x: jax.Array, spec: P) -> jax.Array:
    """``x`` laid out as ``spec``, its ``UNCONSTRAINED`` dimensions as they are.

    A sharding constraint on an Auto mesh; on an Explicit one, where a constraint
    only asserts the type, a ``reshard`` (the free dimensions read from the type).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.axis_names or AxisType.Explicit not in mesh.axis_types:
        return jax.lax.with_sharding_constraint(x, spec)
    current = tuple(jax.typeof(x).sharding.spec) + (None,) * x.ndim
    entries = [current[i] if s is P.UNCONSTRAINED else s for i, s in enumerate(spec)]
    return jax.sharding.reshard(x, P(*entries))


def segment_mask(query_segments: jax.Array, key_segments: jax.Array) -> jax.Array:
    """``[batch, 1, q, k]``: True where a query and a key belong to the same segment.

    >>> segment_mask(jnp.array([[1, 1, 2, 0]]), jnp.array([[1, 1, 2, 0]]))[0, 0].astype(int)
    Array([[1, 1, 0, 0],
           [1, 1, 0, 0],
           [0, 0, 1, 0],
           [0, 0, 0, 1]], dtype=int32)
    """
    return (query_segments[:, None, :, None] == key_segments[:, None, None, :]).astype(bool)


def causal_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    segment_ids: jax.Array | None = None,
    **_: object,
) -> jax.Array:
    """Causal dot-product attention, exact whether or not the sequence is split.

    An ``attention_fn`` for ``nnx.MultiHeadAttention``: arrays are
    ``[batch, seq, heads, head_dim]`` (the heads may be split by a ``model``
    axis, the batch by data axes; both are left as they are). Position ``i``
    attends to positions ``<= i``; ``mask`` (``[batch, heads, q, k]``, True
    to keep) and ``bias`` are applied on top. When the sequence is split
    (``length_axes()``), keys and values are gathered along it and the
    queries stay split; XLA's implementation is used then, whose causal mask
    is built over global positions.

    ``segment_ids`` (``[batch, seq]`` ints, 0 = padding; packed rows) restricts
    each query to the keys of its own segment: gathered with the keys in the
    all-gather form, passed round with them in the ring form (whose blocks
    between segments that cannot meet are skipped).

    >>> q = k = v = jnp.ones((1, 4, 2, 8))
    >>> causal_attention(q, k, v).shape
    (1, 4, 2, 8)
    """
    if query.shape[-3] != key.shape[-3]:  # a decode step: one query against a cache
        return _decode_attention(query, key, value, bias, mask)
    axes = length_axes()
    if axes and _FORM.get() == "ring":
        if bias is not None or mask is not None or len(axes) > 1:
            raise ValueError(
                "ring attention takes no mask or bias (its causal mask is built over global "
                "positions; packed rows pass segment_ids) and one sequence axis (got "
                f"{axes}); use attention='all_gather'."
            )
        return ring_attention(query, key, value, axes[0], segment_ids=segment_ids)
    implementation = attention_implementation(query.dtype)
    free = P.UNCONSTRAINED  # the batch and heads keep whatever layout they have
    split = P(free, axes, free, free)
    if axes:
        whole = P(free, None, free, free)
        query, key, value = _pinned(query, split), _pinned(key, whole), _pinned(value, whole)
        implementation = "xla"  # cuDNN's kernel knows no global positions of a query chunk
    if segment_ids is not None:
        query_segments = key_segments = segment_ids
        if axes:  # the queries' segments stay split with them; the keys' are gathered
            query_segments = _pinned(segment_ids, P(free, axes))
            key_segments = _pinned(segment_ids, P(free, None))
        own = segment_mask(query_segments, key_segments)
        mask = own if mask is None else jnp.logical_and(mask, own)
    out = jax.nn.dot_product_attention(
        query,
        key,
        value,
        bias=bias,
        mask=mask,
        is_causal=True,
        implementation=implementation,
    )
    if axes:
        out = _pinned(out, split)
    return out


def _decode_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array | None,
) -> jax.Array:
    """A decode step's attention: no causal mask of its own (a one-position query
    against a cache would see only the cache's first key), the cache's ``mask`` instead;
    XLA's implementation (cuDNN's wants equal lengths). Flax hands a combined mask as
    0/1 floats (``combine_masks``); ``jax.nn.dot_product_attention`` takes booleans."""
    keep = None if mask is None else mask.astype(bool)
    return jax.nn.dot_product_attention(
        query, key, value, bias=bias, mask=keep, is_causal=False, implementation="xla"
    )
