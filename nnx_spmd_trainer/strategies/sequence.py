"""SequenceParallel: split the batch's sequence dimension; parameters as the others lay them out."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any, ClassVar

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_spmd_trainer import sharding as sh
from nnx_spmd_trainer.adapters.jax_private import CUDNN_ATTENTION_TARGET
from nnx_spmd_trainer.nn.attention import FORMS, LENGTH_NAMES, attention_form
from nnx_spmd_trainer.nn.ring_attention import ring_blocks
from nnx_spmd_trainer.strategies.axis import AxisStrategy
from nnx_spmd_trainer.strategies.base import context_rules


@dataclasses.dataclass(frozen=True, repr=False)
class SequenceParallel(AxisStrategy):
    """Sequence (context) parallelism over one mesh axis: long sequences, split activations.

    - Batch: every leaf with a dimension 1 (the sequence) is split along it
      over this axis; its rows keep the layout the other members of a
      ``Hybrid`` give them (data / FSDP axes). Leaves of one dimension (a
      ``mask``, per-row weights) keep the rows' layout; a batch with no
      leaf of two dimensions or more, or whose sequence the axis does not
      divide, is refused with a ``ShardingError`` naming the leaf.
    - Which rows a process feeds (``data_shard``): processes holding
      different sequence chunks of the same rows feed the same rows, whole
      sequences included; each keeps the chunk its devices need. The axis
      never changes the ``DataShard`` (``Strategy.data_shard``: a dimension
      after the rows is fed split only over batch axes, and this axis is not one).
    - Tracing (``trace_context``): the logical activation names ``length``
      and ``seq`` map to this axis, so ``nnx_spmd_trainer.nn.attention.causal_attention``
      gathers keys and values along it (the queries stay split) and
      ``flax.linen.with_logical_constraint`` splits activations along it. A rule
      for them in an enclosing ``nnx.logical_axis_rules`` wins.
    - Parameters: as the other members lay them out, replicated along this
      axis (gradients are reduced over it like over a data axis).

    The step is still one program over global arrays (the compiler inserts
    the collectives), so results equal one device's; what the axis changes is
    the layout of the activations. So any attention runs split and exact, a
    plain one too (``nnx.MultiHeadAttention``'s default with a causal mask, as
    the JAX tutorials write it): from the split queries the compiler computes
    each device's chunk of the scores against gathered keys and values, the
    same program, collectives and memory per device as
    ``nnx_spmd_trainer.nn.attention.causal_attention`` for the tutorials' GPT-2
    block and for the shipped GPT. ``causal_attention`` pins that layout with
    sharding constraints rather than leaving it to the compiler's propagation:
    prefer it in models of your own.

    ``attention`` picks how ``causal_attention`` attends over the split
    sequence: ``"all_gather"`` (default: above) or ``"ring"``
    (``nnx_spmd_trainer.nn.ring_attention``: keys and values passed round the
    axis a block at a time with ``ppermute``, a balanced causal order, an
    online softmax; keys and values per device fall as ``1/n``). Both are
    exact; the all-gather form is cheaper at short sequences. The ring form
    needs the sequence divisible by ``2n`` and takes effect only in
    ``causal_attention`` (a model's own attention stays as the compiler lays it out).

    Packed rows: a batch's ``segment_ids`` and ``positions`` are ``(rows, sequence)``
    leaves, split along the sequence like the tokens; ``causal_attention(...,
    segment_ids=...)`` gathers the keys' ids with the keys (all-gather form) or passes
    them round the ring with them, skipping blocks no segment spans (docs/topics/packing.md).

    >>> SequenceParallel(4).mesh_axes(), SequenceParallel(4).batch_axes()
    ((('seq', 4),), ())
    >>> SequenceParallel(4, attention="ring")
    SequenceParallel(4, attention='ring')
    """

    usual_axis: ClassVar[str] = "seq"
    shards_batch: ClassVar[bool] = False  # it splits the sequence, not the rows

    axis: str = usual_axis
    attention: str = dataclasses.field(default=FORMS[0], kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.attention not in FORMS:
            raise ValueError(
                f"SequenceParallel(attention={self.attention!r}): choose one of {FORMS}"
            )

    def batch_sharding(self, batch: Any, mesh: Mesh, proposed: Any = None) -> Any:
        """The answer so far, with dimension 1 of every leaf of two dimensions or more
        split over this axis as well."""
        shardings = super().batch_sharding(batch, mesh, proposed)
        if self.axis not in mesh.shape:
            return shardings
        size = mesh.shape[self.axis]
        leaves = jax.tree_util.tree_leaves_with_path(batch)
        if leaves and all(len(np.shape(x)) < 2 for _, x in leaves):
            shapes = {jax.tree_util.keystr(p) or "<root>": tuple(np.shape(x)) for p, x in leaves}
            raise sh.ShardingError(
                f"{self!r}: the batch has no sequence dimension (leaf shapes {shapes}); it "
                "splits dimension 1 of the batch's arrays over mesh axis "
                f"{self.axis!r} ({size} devices). Feed (rows, sequence, ...) arrays, e.g. "
                "token ids of shape (batch_size, seq_len), or use a strategy that splits "
                "only the rows (DataParallel, FSDP)."
            )

        def one(path: Any, x: Any, sharding: NamedSharding) -> NamedSharding:
            shape = tuple(np.shape(x))
            if len(shape) < 2:
                return sharding  # per-row values (a mask): no sequence to split
            if shape[1] % size:
                raise sh.ShardingError(
                    f"{self!r}: batch leaf {jax.tree_util.keystr(path) or '<root>'} has shape "
                    f"{shape}; its sequence (dimension 1) of length {shape[1]} cannot be split "
                    f"over mesh axis {self.axis!r} of {size} devices on mesh "
                    f"{dict(mesh.shape)}. Use a sequence length divisible by {size} (pad "
                    f"the sequences), or SequenceParallel(n) with n dividing {shape[1]}."
                )
            entries = list(sh.dimension_axes(sharding.spec, len(shape)))
            rows = tuple(a for a in entries[0] if a != self.axis)
            entries[0] = rows
            entries[1] = (*entries[1], self.axis)
            spec = [None if not e else e[0] if len(e) == 1 else e for e in entries]
            while spec and spec[-1] is None:
                spec.pop()
            return NamedSharding(mesh, P(*spec))

        return jax.tree_util.tree_map_with_path(one, batch, shardings)

    @contextlib.contextmanager
    def trace_context(self, mesh: Mesh) -> Iterator[None]:
        """The enclosing logical rules, with ``length`` and ``seq`` mapped to this axis,
        inside ``Strategy.trace_context``'s; ``attention_form(self.attention)``."""
        enclosing = context_rules()
        given = {name for name, _ in enclosing}
        own = [(name, self.axis) for name in LENGTH_NAMES if name not in given]
        with (
            super().trace_context(mesh),
            nnx.logical_axis_rules([*enclosing, *own]),
            attention_form(self.attention),
        ):
            yield


def sequence_of(strategy: Any) -> SequenceParallel | None:
    """The ``SequenceParallel`` in ``strategy`` (itself or a ``Hybrid``'s member), else None."""
    if isinstance(strategy, SequenceParallel):
        return strategy
    found = (sequence_of(member) for member in getattr(strategy, "members", ()))
    return next((s for s in found if s is not None), None)


def report_line(
    strategy: Any, mesh: Mesh, collectives: dict[str, dict[str, int]], hlo: str = ""
) -> str:
    """What ``Plan.report`` says of a split sequence: the attention form in force and the
    collective that carries its keys and values (counted in the compiled step); for the
    ring, how its blocks ran: cuDNN's fused kernel where the compiled step ``hlo`` calls
    it, else the einsum blocks (``ring_attention.block_implementation``). ``""`` without
    a ``SequenceParallel`` on a mesh axis of more than one device."""
    member = sequence_of(strategy)
    if member is None or mesh.shape.get(member.axis, 1) < 2:
        return ""
    n = mesh.shape[member.axis]
    if member.attention == "ring":
        blocks = ring_blocks(n)
        how = (
            f"ring (keys and values passed round {member.axis!r}, 1/{n} of them per device; "
            f"balanced causal order, {min(blocks)}-{max(blocks)} blocks per device): "
            f"collective-permute x{collectives.get('collective-permute', {}).get('count', 0)}"
            f"; {_ring_blocks_said(hlo)}"
        )
    else:
        how = (
            f"all_gather (keys and values gathered along {member.axis!r}, the whole sequence's "
            f"per device): all-gather x{collectives.get('all-gather', {}).get('count', 0)}"
        )
    return f"sequence: split over {member.axis!r} ({n} devices), attention {how}"


def _ring_blocks_said(hlo: str) -> str:
    """The ring's blocks as the compiled step runs them: cuDNN kernels are custom calls."""
    kernels = hlo.count(f'custom_call_target="{CUDNN_ATTENTION_TARGET}')
    if kernels:
        return f"blocks cudnn (fused attention, {kernels} kernel call sites in the step)"
    return "blocks einsum (fp32 scores)"
