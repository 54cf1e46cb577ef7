"""PlanSettings: the thirteen settings a ``Plan`` is made with: their names, types and defaults.

``Plan(...)`` and ``Trainer(...)`` take them as keywords (their signatures' defaults are
read from ``DEFAULTS``; ``tests/test_plan_settings.py`` checks both name every one) and
gather them by name (``PlanSettings.of``); ``Trainer(plan, ...)`` names the ones given
beside a plan (``PlanSettings.given``); ``strategy="auto"`` plans each candidate with them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import optax
from clu import metrics as clu_metrics
from flax import nnx

from nnx_spmd_trainer.nn.lora import LoRA
from nnx_spmd_trainer.optim.ema import EMA
from nnx_spmd_trainer.optim.spikes import SpikeSkip
from nnx_spmd_trainer.strategies import Strategy


@dataclasses.dataclass(frozen=True)
class PlanSettings:
    """What a plan is made with besides the model and the losses (see ``Plan``'s Args).

    A default of ``None`` means "chosen by the plan": ``DataParallel()``, the average
    loss, every device of ``jax.devices()``, the backend's measured ``donate``.
    """

    optimizer: optax.GradientTransformation | None = None
    #: A ``Strategy``; a ``Trainer``'s may also be ``"auto"`` or ``auto.Auto(...)``.
    strategy: Strategy | Any = None
    metrics: type[clu_metrics.Collection] | None = None
    seed: int = 0
    grad_accum_steps: int = 1
    wrt: nnx.filterlib.Filter = nnx.Param
    devices: Sequence[jax.Device] | None = None
    donate: bool | None = None
    remat: str = "none"
    skip_nonfinite_updates: bool = False
    ema: EMA | None = None
    skip_spikes: SpikeSkip | None = None
    lora: LoRA | None = None

    @classmethod
    def of(cls, arguments: Mapping[str, Any]) -> PlanSettings:
        """The settings named in ``arguments`` (the ``locals()`` of a function that takes
        them as keywords: ``Plan.__init__``, ``Trainer.__init__``); other names are left.

        >>> settings = PlanSettings.of({**DEFAULTS.as_kwargs(), "seed": 3, "model": None})
        >>> settings.seed, settings.given()
        (3, ['seed'])
        """
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in arguments]
        if missing:
            raise TypeError(f"PlanSettings.of: no {', '.join(missing)} among the arguments.")
        return cls(**{f.name: arguments[f.name] for f in dataclasses.fields(cls)})

    def given(self) -> list[str]:
        """The names of the settings that are not their defaults, in declaration order.

        An object default (``None``, the ``nnx.Param`` filter) is compared by identity:
        ``wrt`` filters need not define ``==`` (a filter of arrays would broadcast)."""
        return [
            f.name
            for f in dataclasses.fields(self)
            if not _is_default(getattr(self, f.name), f.default)
        ]

    def as_kwargs(self, *, without: tuple[str, ...] = ()) -> dict[str, Any]:
        """The settings as keyword arguments (``Plan(model, **kwargs)``), less ``without``."""
        return {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in without
        }


def _is_default(value: Any, default: Any) -> bool:
    if default is None or not isinstance(default, int | str | bool):
        return value is default
    return bool(value == default)


#: The defaults, for the signatures that take the settings as keywords.
DEFAULTS = PlanSettings()
