"""ExpertParallel: split the experts of mixture-of-experts layers; the axis is FSDP elsewhere."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import jax
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from nnx_spmd_trainer import sharding as sh
from nnx_spmd_trainer.strategies.axis import AxisStrategy
from nnx_spmd_trainer.strategies.base import Strategy, context_rules, is_variable
from nnx_spmd_trainer.strategies.data_parallel import DataParallel
from nnx_spmd_trainer.strategies.fsdp import FSDP
from nnx_spmd_trainer.strategies.hybrid import Hybrid


@dataclasses.dataclass(frozen=True, repr=False)
class ExpertParallel(AxisStrategy):
    """Expert parallelism over one mesh axis: each device holds ``E / size`` experts.

    - Parameters: leaves annotated with the logical name ``experts``
      (``nnx_spmd_trainer.nn.moe.MoE``'s expert weights ``(E, ...)``) are split
      along it over this axis; every other leaf of at least ``min_size``
      elements is split along its largest dimension the axis divides, as
      ``FSDP`` does (the axis is an FSDP axis for the dense part of the
      model, so nothing large stays replicated on it). The number of experts
      must be divisible by the axis size.
    - Batch: the rows are split over this axis too (a data axis for every
      layer but the experts).
    - Tracing (``trace_context``): the logical name ``experts`` maps to this
      axis, so ``MoE`` exchanges its dispatched tokens ``(batch, experts,
      capacity, embed)`` over it: an ``all_to_all`` sends each token to its
      experts' devices and another brings the outputs back. A dropless block
      (``capacity_factor=None``) sends each expert's sorted rows instead:
      ``ragged_all_to_all`` on GPU/TPU, an ``all_to_all`` padded to the worst case on
      CPU (``nn.moe_dropless``). A rule for ``experts`` in an enclosing
      ``nnx.logical_axis_rules`` wins.

    The step is one program over global arrays and routing is decided per
    sequence (``moe``), so every layout computes the one-device result.

    >>> ExpertParallel(4).mesh_axes(), ExpertParallel(4).batch_axes()
    ((('expert', 4),), ('expert',))
    >>> dict(ExpertParallel(4).logical_rules())["experts"]
    'expert'
    """

    usual_axis: ClassVar[str] = "expert"
    logical_axes: ClassVar[tuple[str, ...]] = ("experts",)

    axis: str = usual_axis
    #: Unannotated leaves smaller than this (in elements) stay replicated.
    min_size: int = dataclasses.field(default=1024, kw_only=True)

    def refine_spec(self, spec: P, shape: tuple[int, ...], mesh: dict[str, int]) -> P:
        if self.axis_types == "explicit":
            return spec  # the model's declared types are the layout (as FSDP's)
        if self.axis not in mesh or math.prod(shape) < self.min_size:
            return spec
        return sh.shard_largest_dim(spec, shape, self.axis, mesh[self.axis])

    @contextlib.contextmanager
    def trace_context(self, mesh: Mesh) -> Iterator[None]:
        """The enclosing logical rules with ``experts`` mapped to this axis, inside
        ``Strategy.trace_context``'s."""
        enclosing = context_rules()
        own = [] if "experts" in {name for name, _ in enclosing} else [("experts", self.axis)]
        with super().trace_context(mesh), nnx.logical_axis_rules([*enclosing, *own]):
            yield


def num_experts(factory: Callable[[nnx.Rngs], Any]) -> int:
    """The experts of the model ``factory`` builds: the size of the largest dimension any of
    its parameters annotates ``experts`` (0 for a model without experts). Traced, not built.

    >>> from nnx_spmd_trainer.nn.moe import MoE
    >>> num_experts(lambda rngs: MoE(8, 16, num_experts=4, rngs=rngs))
    4
    """
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: factory(nnx.Rngs(0)))
    found = [0]
    for variable in jax.tree.leaves(nnx.state(abstract), is_leaf=is_variable):
        names = variable.get_metadata().get("out_sharding") or ()
        shape = getattr(variable.get_value(), "shape", ())
        found += [shape[i] for i, name in enumerate(names) if name == "experts" and i < len(shape)]
    return max(found)


def expert_candidates(device_count: int, experts: int) -> list[Strategy]:
    """The expert layouts ``strategy="auto"`` adds for a model of ``experts`` experts: for
    each expert-axis size above 1 dividing both, ``ExpertParallel`` alone when it takes
    every device, else ``DataParallel`` and ``FSDP`` over the devices left, times it.

    >>> expert_candidates(8, 0)
    []
    >>> expert_candidates(8, 4)  # doctest: +NORMALIZE_WHITESPACE
    [Hybrid(DataParallel(4), ExpertParallel(2)), Hybrid(FSDP(4), ExpertParallel(2)),
     Hybrid(DataParallel(2), ExpertParallel(4)), Hybrid(FSDP(2), ExpertParallel(4))]
    """
    found: list[Strategy] = []
    for size in range(2, device_count + 1) if experts > 1 else ():  # no experts: none
        if device_count % size or experts % size:
            continue
        rest = device_count // size
        if rest == 1:
            found.append(ExpertParallel(size))
        else:
            found += [Hybrid(DataParallel(rest), ExpertParallel(size)),
                      Hybrid(FSDP(rest), ExpertParallel(size))]  # fmt: skip
    return found
