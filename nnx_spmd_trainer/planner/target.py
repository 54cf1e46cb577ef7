"""A target: TPU chips (or GPUs) a plan is made for that need not be here.

``Target.parse("v5e-16")`` (Cloud TPU's accelerator names), ``"v5p:4x4x4"`` (topology
strings) or ``"2xv5e-256"`` (several slices, joined by the data-centre network) names
the chips; ``target.devices`` describes them, from ``libtpu``'s own topology
(``jax.experimental.topologies.get_topology_desc``), and a ``Plan`` made on them
(``Plan(..., devices=target)``) is compiled by the real TPU compiler on this CPU:
its memory verdict and cost analysis are the chips'. No array can live on them:
nothing of such a plan is ever materialised.

Needs the ``libtpu`` wheel (``pip install 'nnx-spmd-trainer[tpu-plan]'``); without it
``devices`` raises ``TargetUnavailable`` naming the extra. H100s (``h100-8``: one host;
``h100-16``: two hosts of 8, joined by the network as slices are) are compiled by XLA's
GPU compiler through jax's CUDA plugin (``target_gpu``, ``[gpu-plan]``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os
import re
from collections.abc import Sequence
from typing import Any

import jax

from nnx_spmd_trainer.planner import target_gpu
from nnx_spmd_trainer.planner.target_chips import ALIASES, CHIPS, ChipSpec

#: Slice shapes by chip count: a 2D torus's (v5e, v6e: Cloud TPU's supported shapes;
#: 1x1 is left out, libtpu's compile-only topology refuses it) and a 3D torus's (v5p).
SHAPES_2D = {4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
SHAPES_3D = {
    4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
    256: "4x8x8", 512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16",
    6144: "16x16x24",
}  # fmt: skip
#: A host's GPUs (a slice of GPUs is a host: NVLink inside, the network between).
SHAPES_1D = {1: "1", 2: "2", 4: "4", 8: "8"}
#: The extra that installs libtpu, named where it is missing.
EXTRA = "pip install 'nnx-spmd-trainer[tpu-plan]'"

_NAME = re.compile(
    r"^(?:(?P<slices>\d+)x)?(?P<gen>[a-z0-9]+?)(?:-(?P<count>\d+)|:(?P<shape>\d+(?:x\d+)*))$"
)


class TargetError(ValueError):
    """A target name that names no chips we know, or a shape they do not come in."""


class TargetUnavailable(RuntimeError):
    """libtpu, which describes and compiles for TPU chips, is not installed."""


def _shapes(spec: ChipSpec) -> dict[int, str]:
    return {1: SHAPES_1D, 2: SHAPES_2D, 3: SHAPES_3D}[spec.chip_axes]


def known_targets() -> list[str]:
    """Example names, one per generation and form (for messages)."""
    names = []
    for spec in CHIPS.values():
        if spec.platform == "gpu":
            names.append(f"{spec.name}-N (N in 1, 2, 4, 8, or hosts of 8: 16, 24, ...)")
            continue
        shapes = _shapes(spec)
        counts = [c * spec.cores_per_chip for c in shapes]
        names.append(
            f"{spec.name}-N (N in {', '.join(map(str, counts))}), "
            f"{spec.name}:{shapes[max(c for c in shapes if c <= 64)]}"
        )
    return names


def _unknown(name: str, why: str) -> TargetError:
    return TargetError(
        f"target {name!r}: {why}. Known targets: {'; '.join(known_targets())}; "
        "several slices: 2xv5e-256."
    )


@dataclasses.dataclass(frozen=True)
class Target:
    """TPU chips to plan for: a generation, the shape of one slice, and how many slices.

    Attributes:
      generation: ``"v5e"``, ``"v5p"`` or ``"v6e"`` (``CHIPS``).
      shape: one slice's chips as a torus, ``"4x4"`` or ``"4x4x4"``.
      slices: slices joined by the data-centre network (DCN); a mesh's outermost axes
        span them, as ``Hybrid(..., across_hosts=)`` places them.

    >>> Target.parse("v5p-128")
    Target(generation='v5p', shape='4x4x4', slices=1)
    >>> t = Target.parse("2xv5e-256"); (t.name, t.chips, t.chips_per_slice)
    ('2xv5e:16x16', 512, 256)
    """

    generation: str
    shape: str
    slices: int = 1

    @classmethod
    def parse(cls, name: str | Target) -> Target:
        """A ``Target`` from Cloud TPU's accelerator name (``v5e-16``, ``v5litepod-16``;
        ``v5p-128`` counts TensorCores, two a chip), a topology string
        (``v5e:4x4``, ``v5p:4x4x4``) or either with a slice count (``2xv5e-256``)."""
        if isinstance(name, Target):
            return name
        match = _NAME.match(str(name).strip().lower())
        if match is None:
            raise _unknown(str(name), "not a TPU name like v5e-16, v5p:4x4x4 or 2xv5e-256")
        generation = ALIASES.get(match["gen"], match["gen"])
        spec = CHIPS.get(generation)
        if spec is None:
            raise _unknown(str(name), f"no chip {match['gen']!r} in the table")
        shapes = _shapes(spec)
        hosts = 1
        if match["count"] is not None:
            count = int(match["count"])
            chips, odd = divmod(count, spec.cores_per_chip)
            if spec.platform == "gpu" and chips > max(shapes) and chips % max(shapes) == 0:
                hosts, chips = chips // max(shapes), max(shapes)  # hosts of 8 GPUs
            if odd or chips not in shapes:
                sizes = ", ".join(str(c * spec.cores_per_chip) for c in shapes)
                raise _unknown(str(name), f"{generation} comes in {sizes}, not {count}")
            shape = shapes[chips]
        else:
            shape = match["shape"]
            if len(shape.split("x")) != spec.chip_axes:
                raise _unknown(str(name), f"{generation} is a {spec.chip_axes}D torus, not {shape}")
        slices = int(match["slices"] or 1) * hosts
        if slices < 1:
            raise _unknown(str(name), "at least one slice")
        return cls(generation, shape, slices)

    @property
    def chip(self) -> ChipSpec:
        return CHIPS[self.generation]

    @property
    def name(self) -> str:
        prefix = f"{self.slices}x" if self.slices > 1 else ""
        return f"{prefix}{self.generation}:{self.shape}"

    @property
    def chips_per_slice(self) -> int:
        return math.prod(int(n) for n in self.shape.split("x"))

    @property
    def chips(self) -> int:
        return self.chips_per_slice * self.slices

    @functools.cached_property
    def devices(self) -> list[jax.Device]:
        """The chips, described by libtpu (no chip is here: nothing can be placed on
        them); several slices' chips carry their ``slice_index`` (GPUs: each host's,
        its ``process_index``)."""
        if self.chip.platform == "gpu":
            if not target_gpu.cuda_plugin_installed():
                raise TargetUnavailable(
                    f"planning for GPUs ({self.name}) needs jax's CUDA plugin: {target_gpu.EXTRA}"
                )
            return target_gpu.topology_devices(self.generation, int(self.shape), self.slices)
        return topology_devices(self.generation, self.shape, self.slices)

    def __str__(self) -> str:
        return self.name


def libtpu_installed() -> bool:
    return importlib.util.find_spec("libtpu") is not None


@functools.cache
def topology_devices(generation: str, shape: str, slices: int) -> list[jax.Device]:
    """libtpu's compile-only description of the chips (cached: one per process)."""
    if not libtpu_installed():
        raise TargetUnavailable(
            f"planning for TPU chips ({generation}:{shape}) needs libtpu: {EXTRA}"
        )
    # No TPU metadata server here (MaxText's CI sets these too); a libtpu already loaded
    # by another process on this machine must not refuse this one.
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    kwargs: dict[str, Any] = {"num_slices": slices} if slices > 1 else {}
    described = topologies.get_topology_desc(
        platform="tpu", topology_name=f"{generation}:{shape}", **kwargs
    )
    return list(described.devices)


def resolve_devices(devices: Any) -> Sequence[jax.Device] | None:
    """``devices`` as a plan takes them: a ``Target`` or a target name becomes its
    chips; anything else is returned as given."""
    if isinstance(devices, Target | str):
        return Target.parse(devices).devices
    return devices  # type: ignore[no-any-return]


def is_target(devices: Sequence[jax.Device]) -> bool:
    """Whether ``devices`` are chips described, not present (a ``Target``'s): their
    client compiles only."""
    return any(type(d.client).__name__ == "CompileOnlyPyClient" for d in devices[:1])


def slice_of(device: jax.Device) -> int:
    """The slice a chip is in (0 where the devices carry none); a GPU's is its host."""
    if device.platform == "gpu":
        return int(device.process_index)
    return int(getattr(device, "slice_index", 0) or 0)
