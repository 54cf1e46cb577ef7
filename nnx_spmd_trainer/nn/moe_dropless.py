"""Dropless dispatch for ``MoE(capacity_factor=None)``: every token reaches its top-k experts.

Each device sorts its own token choices by expert, runs the expert MLPs as grouped
matmuls (``jax.lax.ragged_dot`` with the number of rows of each expert), puts the
outputs back in token order and combines them with the router weights. Nothing is
dropped, so no layout and no batch split changes the result.

Where it runs: in a ``shard_map`` manual over the batch's mesh axes (and the expert
axis): each device routes its own rows; every other mesh axis (a ``model`` axis
splitting each expert's ``mlp``) stays the compiler's.

- No expert axis: each device runs every expert on its own tokens (the weights
  gathered whole, as FSDP gathers any weight).
- An expert axis of ``n`` devices, each holding ``E / n`` experts: the sorted rows
  go to their experts' devices and come back (``_exchange_padded`` or
  ``_exchange_ragged``). A device holds ``A = local tokens x top_k`` rows and may
  receive up to ``n x A`` (every device sending all its rows to it): that worst case
  is the static size of the receive buffer, on every backend.

Which backend takes which exchange (``exchange_for``):

- GPU and TPU: ``jax.lax.ragged_all_to_all`` moves only the rows that exist
  (``A`` rows out per device, however they are spread), into the ``n x A`` buffer.
- CPU (and any other backend): ``ragged_all_to_all`` does not run there, so each
  device pads its rows for every destination to ``A`` and sends ``(n, A, embed)``
  with one ``all_to_all``: ``n`` times the bytes of the real rows each way, exact.

Cost of ``ragged_dot`` itself: on GPU it lowers to a grouped matmul (Triton or
XLA's ragged dot), on TPU to XLA's ragged dot; on CPU JAX lowers it to a masked dense
product ``(groups, rows, in) x (groups, in, out)``, so there every row pays for every
local expert: ``E_local / top_k`` times the useful FLOPs (benchmarks/moe_dispatch.py).
"""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from nnx_spmd_trainer.nn import tracing

__all__ = ["Exchange", "dropless_experts", "exchange_for"]

#: How sorted rows reach the devices of their experts under an expert axis.
Exchange = Literal["ragged_all_to_all", "all_to_all"]


def exchange_for(platform: str) -> Exchange:
    """The exchange a backend runs: ``ragged_all_to_all`` on GPU and TPU, where XLA
    implements it; the padded ``all_to_all`` elsewhere (CPU).

    >>> exchange_for("gpu"), exchange_for("cpu")
    ('ragged_all_to_all', 'all_to_all')
    """
    return "ragged_all_to_all" if platform in ("gpu", "cuda", "rocm", "tpu") else "all_to_all"


def dropless_experts(
    x: jax.Array,
    weights: jax.Array,
    chosen_ids: jax.Array,
    wi: jax.Array,
    wo: jax.Array,
    *,
    expert_axes: tuple[str, ...] = (),
    exchange: Exchange | None = None,
) -> jax.Array:
    """``sum_k weights[..., k] * expert_{chosen_ids[..., k]}(x)`` for every token.

    Args:
      x: tokens ``(batch, seq, embed)`` in the compute dtype.
      weights: the router weights of each token's choices ``(batch, seq, top_k)``.
      chosen_ids: the experts chosen ``(batch, seq, top_k)`` (distinct per token).
      wi, wo: the expert weights ``(E, embed, ff)`` and ``(E, ff, embed)``.
      expert_axes: the mesh axis splitting the experts (``moe.expert_axes()``), or ``()``.
      exchange: the collective under an expert axis; ``None``: ``exchange_for`` the
        default backend.
    """
    if len(expert_axes) > 1:
        raise ValueError(
            f"MoE: the experts map to several mesh axes {expert_axes}; map them to one."
        )
    expert_axis = expert_axes[0] if expert_axes else None
    mesh = jax.sharding.get_abstract_mesh()
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True)) if mesh.axis_names else {}
    rows_axes = tracing.traced_axes("batch")
    if x.shape[0] % math.prod(sizes[name] for name in rows_axes):
        # Fewer rows than the batch's split here (a pipeline's microbatch): they stay the
        # compiler's, as under no batch rule.
        rows_axes = ()
    if expert_axis is not None and expert_axis not in rows_axes:
        rows_axes = (*rows_axes, expert_axis)  # each expert device routes its own rows
    kind = exchange or exchange_for(jax.default_backend())

    def local(x, weights, chosen_ids, wi, wo):  # type: ignore[no-untyped-def]
        return _route_local(x, weights, chosen_ids, wi, wo, expert_axis, kind)

    if not rows_axes:  # no mesh splits the rows: one device's computation
        return local(x, weights, chosen_ids, wi, wo)
    split = math.prod(sizes[name] for name in rows_axes)
    if x.shape[0] % split:
        raise ValueError(
            f"MoE (dropless): the batch of {x.shape[0]} rows does not split over the mesh "
            f"axes {rows_axes} ({split} devices); use a batch size divisible by {split}."
        )
    rows = P(rows_axes)
    experts = P(expert_axis)  # P(None) when no axis splits the experts: gathered whole
    return jax.shard_map(
        local,
        in_specs=(rows, rows, rows, experts, experts),
        out_specs=rows,
        axis_names=set(rows_axes),
    )(x, weights, chosen_ids, wi, wo)


def _route_local(
    x: jax.Array,
    weights: jax.Array,
    chosen_ids: jax.Array,
    wi: jax.Array,
    wo: jax.Array,
    expert_axis: str | None,
    exchange: Exchange,
) -> jax.Array:
    """One device's tokens: sorted by expert, through the experts (here or on the expert
    axis's devices), unsorted and combined."""
    embed, top_k = x.shape[-1], chosen_ids.shape[-1]
    tokens = x.reshape(-1, embed)
    ids = chosen_ids.reshape(-1)  # (A,): token t's k-th choice at t * top_k + k
    order = jnp.argsort(ids, stable=True)
    rows = tokens[order // top_k]  # (A, embed), grouped by expert
    num_experts = wi.shape[0] * (1 if expert_axis is None else jax.lax.axis_size(expert_axis))
    counts = jnp.bincount(ids, length=num_experts).astype(jnp.int32)
    if expert_axis is None:
        out = _grouped_mlp(rows, counts, wi, wo)
    else:
        out = _on_expert_devices(rows, counts, wi, wo, expert_axis, exchange)
    unsorted = out[_inverse(order)].reshape(*chosen_ids.shape, embed)
    return jnp.einsum("bsk,bskd->bsd", weights.astype(out.dtype), unsorted)


def _grouped_mlp(
    rows: jax.Array, group_sizes: jax.Array, wi: jax.Array, wo: jax.Array
) -> jax.Array:
    """Rows grouped by expert (``group_sizes`` rows each, any rest padding) through their
    experts' MLPs; padding rows come out as zeros (``ragged_dot`` leaves them out)."""
    dtype = rows.dtype
    hidden = jax.lax.ragged_dot(rows, wi.astype(dtype), group_sizes, preferred_element_type=dtype)
    hidden = nnx.gelu(hidden)
    out = jax.lax.ragged_dot(hidden, wo.astype(dtype), group_sizes, preferred_element_type=dtype)
    real = jnp.arange(rows.shape[0]) < jnp.sum(group_sizes)
    return jnp.where(real[:, None], out, jnp.zeros_like(out))


def _inverse(order: jax.Array) -> jax.Array:
    """The permutation undoing ``order`` (``x[order][_inverse(order)] == x``)."""
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))


def _on_expert_devices(
    rows: jax.Array,
    counts: jax.Array,
    wi: jax.Array,
    wo: jax.Array,
    axis: str,
    exchange: Exchange,
) -> jax.Array:
    """Rows sorted by (global) expert sent to the devices holding their experts, through
    the local experts there, and back in the order they left."""
    n, local_experts = jax.lax.axis_size(axis), wi.shape[0]
    sent = counts.reshape(n, local_experts)  # [destination, its expert]
    received = jax.lax.all_to_all(sent, axis, 0, 0, tiled=True)  # [source, my expert]
    to_device = sent.sum(axis=1)
    starts = jnp.cumsum(to_device) - to_device  # where each destination's rows begin
    buffer = _send(rows, starts, to_device, received.sum(axis=1), axis, exchange)  # (n, A, d)

    # The buffer holds, per source, its rows grouped by my experts, then padding:
    # regroup by expert across sources, through the experts, and back to buffer order.
    slot = jnp.arange(rows.shape[0])
    ends = jnp.cumsum(received, axis=1)  # (n, E_local)
    expert = jnp.sum(slot[None, None, :] >= ends[:, :, None], axis=1)  # (n, A); E_local: padding
    by_expert = jnp.argsort(expert.reshape(-1), stable=True)
    flat = buffer.reshape(-1, buffer.shape[-1])
    out = _grouped_mlp(flat[by_expert], received.sum(axis=0), wi, wo)
    out = out[_inverse(by_expert)].reshape(buffer.shape)
    return _send_back(out, starts, to_device, received.sum(axis=1), axis, exchange)


def _send(
    rows: jax.Array,
    starts: jax.Array,
    sizes: jax.Array,
    incoming: jax.Array,
    axis: str,
    exchange: Exchange,
) -> jax.Array:
    """``rows`` (A, d), destination ``j``'s ``sizes[j]`` rows from ``starts[j]``, sent; the
    result ``(n, A, d)`` holds source ``i``'s rows at ``[i, :incoming[i]]``, zeros after."""
    n, length = jax.lax.axis_size(axis), rows.shape[0]
    if exchange == "ragged_all_to_all":
        me = jax.lax.axis_index(axis)
        out = jax.lax.ragged_all_to_all(
            rows,
            _zeros_varying_as(rows, (n * length, rows.shape[1])),
            starts,
            sizes,
            jnp.full((n,), me * length, starts.dtype),  # my block on every receiver
            incoming,
            axis_name=axis,
        )
        return out.reshape(n, length, rows.shape[1])
    padded = _padded_blocks(rows, starts, sizes)
    return jax.lax.all_to_all(padded, axis, 0, 0, tiled=True)


def _send_back(
    out: jax.Array,
    starts: jax.Array,
    sizes: jax.Array,
    incoming: jax.Array,
    axis: str,
    exchange: Exchange,
) -> jax.Array:
    """The inverse of ``_send``: ``out`` (n, A, d) in buffer order returned to its sources;
    the result (A, d) in the order the rows left (``starts``/``sizes`` as ``_send``'s)."""
    n, length, embed = out.shape
    if exchange == "ragged_all_to_all":
        there = jax.lax.all_to_all(starts, axis, 0, 0, tiled=True)  # where mine sit at home
        return jax.lax.ragged_all_to_all(
            out.reshape(n * length, embed),
            _zeros_varying_as(out, (length, embed)),
            jnp.arange(n, dtype=starts.dtype) * length,
            incoming,
            there,
            sizes,
            axis_name=axis,
        )
    back = jax.lax.all_to_all(out, axis, 0, 0, tiled=True)  # [destination, its rows]
    # Row p went to the destination whose block holds it, at p - starts[destination].
    slot = jnp.arange(length)
    destination = jnp.sum(slot[:, None] >= (starts + sizes)[None, :], axis=1)
    destination = jnp.minimum(destination, n - 1)
    return back[destination, slot - starts[destination]]


def _padded_blocks(rows: jax.Array, starts: jax.Array, sizes: jax.Array) -> jax.Array:
    """``(n, A, d)``: block ``j`` = ``rows[starts[j] : starts[j] + sizes[j]]``, zero-padded to A."""
    length = rows.shape[0]
    slot = jnp.arange(length)
    index = jnp.minimum(starts[:, None] + slot[None, :], length - 1)
    valid = slot[None, :] < sizes[:, None]
    return jnp.where(valid[..., None], rows[index], jnp.zeros((), rows.dtype))


def _zeros_varying_as(like: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Zeros typed as varying over the manual axes ``like`` varies over: the receive buffer
    of ``ragged_all_to_all``, whose result takes its buffer's type."""
    zeros = jnp.zeros(shape, like.dtype)
    axes = tuple(sorted(getattr(jax.typeof(like), "vma", ())))
    return jax.lax.pcast(zeros, axes, to="varying") if axes else zeros
