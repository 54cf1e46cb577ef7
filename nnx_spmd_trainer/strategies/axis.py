"""AxisStrategy: the base of the single-axis strategies (one mesh axis, optional rules)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from nnx_spmd_trainer import sharding as sh
from nnx_spmd_trainer.strategies import axis_types as modes
from nnx_spmd_trainer.strategies.base import Axes, Strategy


def _default(field: dataclasses.Field[Any]) -> object:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING  # a required field: always shown


@dataclasses.dataclass(frozen=True, repr=False)
class AxisStrategy(Strategy):
    """One mesh axis, optional logical-axis rules; a subclass says what the axis does.

    A subclass names its ``usual_axis`` (the default of ``axis``), whether
    the axis splits the batch, and which logical names it maps onto the
    axis; it may also ``refine_spec``.

    >>> @dataclasses.dataclass(frozen=True, repr=False)
    ... class Stages(AxisStrategy):
    ...     usual_axis: ClassVar[str] = "stage"
    ...     axis: str = usual_axis
    ...     shards_batch: ClassVar[bool] = False
    >>> Stages(4), Stages(4).mesh_axes(), Stages(4).batch_axes()
    (Stages(4), (('stage', 4),), ())

    Attributes:
      size: devices along this strategy's mesh axis; -1 means "all left".
      axis: the mesh axis name.
      rules: extra logical-axis rules, merged over the strategy's defaults.
      axis_types: ``"auto"`` (default) or ``"explicit"``: the mesh's axis types
        (``strategies.axis_types``); ``"explicit"`` for models written for JAX's
        explicit sharding mode.
    """

    #: The axis's name unless ``axis=`` renames it; annotations naming it still apply.
    usual_axis: ClassVar[str] = ""
    #: Whether the batch is split along this strategy's axis.
    shards_batch: ClassVar[bool] = True
    #: Logical axis names this strategy maps onto its own mesh axis by default.
    logical_axes: ClassVar[tuple[str, ...]] = ()

    size: int = -1
    axis: str = ""
    rules: sh.Rules = dataclasses.field(default=(), kw_only=True)
    axis_types: modes.AxisTypes = dataclasses.field(default="auto", kw_only=True)

    def __post_init__(self) -> None:
        modes.checked(self.axis_types, type(self).__name__)
        if not self.usual_axis or not self.axis:
            raise TypeError(
                f"{type(self).__name__} names no mesh axis. AxisStrategy is a base: use "
                "DataParallel, FSDP or TensorParallel, or subclass it with "
                'usual_axis: ClassVar[str] = "name" and axis: str = usual_axis.'
            )
        # FSDP, TensorParallel and ExpertParallel compare it with each leaf's size at plan
        # time, where a string or a negative number would fail far from where it was given.
        min_size = getattr(self, "min_size", 0)
        if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 0:
            raise ValueError(
                f"{type(self).__name__}(min_size={min_size!r}): min_size is a number of "
                "elements, an int >= 0 (leaves smaller than it are left as they are); "
                "2**63 leaves every unannotated leaf alone."
            )

    def mesh_axes(self) -> Axes:
        return ((self.axis, self.size),)

    def batch_axes(self) -> tuple[str, ...]:
        return (self.axis,) if self.shards_batch else ()

    def axis_roles(self) -> dict[str, str]:
        return {self.axis: self.usual_axis}  # a renamed axis keeps its strategy's role

    def logical_rules(self) -> sh.Rules:
        user = dict(sh.merge_rules(self.rules))
        # A renamed axis (TensorParallel(axis="tp")) still honours its usual physical
        # name in annotations ("model"), read as a logical name for the new axis.
        usual = (self.usual_axis,) if self.axis != self.usual_axis else ()
        own = ((n, self.axis) for n in (*self.logical_axes, *usual) if n not in user)
        return sh.merge_rules(user.items(), own, ((n, None) for n in sh.LOGICAL_AXES))

    def __repr__(self) -> str:
        # Every field that changes the answers and differs from its default; size positional.
        args = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not field.repr or value == _default(field):
                continue
            args.append(repr(value) if field.name == "size" else f"{field.name}={value!r}")
        return f"{type(self).__name__}({', '.join(args)})"
