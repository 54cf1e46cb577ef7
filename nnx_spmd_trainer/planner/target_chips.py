"""What one TPU chip (or GPU) holds and moves, by kind: the figures a plan for chips that
are not here is checked against (``planner/target.py``).

A chip described by ``jax.experimental.topologies`` cannot be asked its memory
(``memory_stats()``: "only supported for addressable PjRt devices"), so the HBM per
chip comes from this table, as do the rates a roofline step time is bounded by.
Every TPU figure is Google's own, from the Cloud TPU system-architecture pages (the
``source`` of each row); where a page gives a per-pod or per-host figure, the
per-chip one is derived and the derivation is written beside it. The H100's are
NVIDIA's datasheet's, its memory the size XLA's own description of the GPU gives.
"""

from __future__ import annotations

import dataclasses
import re

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class ChipSpec:
    """One TPU chip's figures (bytes, FLOP/s and bytes/s; bandwidths per chip).

    Attributes:
      name: the generation as Cloud TPU names it (``"v5e"``).
      device_kind: ``jax.Device.device_kind`` of its chips (``"TPU v5 lite"``).
      hbm_bytes: HBM per chip, in GiB as XLA counts it: the TPU compiler refuses a
        program over this less what the runtime reserves (15.75 of v5e's 16 GiB).
      bf16_flops: dense peak bf16 FLOP/s per chip.
      hbm_bandwidth: HBM bytes/s per chip.
      ici_bandwidth: inter-chip interconnect bytes/s per chip, both directions of all
        its links together: an optimistic rate, so the time it gives is a lower bound.
      dcn_bandwidth: data-centre network bytes/s per chip, between slices.
      chip_axes: 2 (a 2D torus) or 3 (a 3D torus): the shape of a topology string; 1
        for GPUs (a host's GPUs, joined by NVLink: ``ici_bandwidth``; hosts by the
        network: ``dcn_bandwidth``).
      cores_per_chip: TensorCores per chip; Cloud TPU's ``v5p-128`` counts cores.
      source: where the figures are from.
      platform: ``"tpu"`` (compiled by libtpu) or ``"gpu"`` (by jax's CUDA plugin).
    """

    name: str
    device_kind: str
    hbm_bytes: int
    bf16_flops: float
    hbm_bandwidth: float
    ici_bandwidth: float
    dcn_bandwidth: float
    chip_axes: int
    cores_per_chip: int
    source: str
    platform: str = "tpu"


CHIPS: dict[str, ChipSpec] = {
    # cloud.google.com/tpu/docs/v5e, "System architecture": 197 TFLOPs bf16; HBM2 16 GB
    # (XLA: 16 GiB, 15.75 available), 819 GBps; bidirectional ICI 400 GBps per chip; data
    # centre network 6.4 Tbps per 256-chip pod (2 x 100 Gbps NICs per 8-chip host): 25 Gbps
    # = 3.125 GB/s per chip.
    "v5e": ChipSpec(
        name="v5e",
        device_kind="TPU v5 lite",
        hbm_bytes=16 * GiB,
        bf16_flops=197e12,
        hbm_bandwidth=819e9,
        ici_bandwidth=400e9,
        dcn_bandwidth=25e9 / 8,
        chip_axes=2,
        cores_per_chip=1,
        source="cloud.google.com/tpu/docs/v5e (System architecture)",
    ),
    # cloud.google.com/tpu/docs/v5p, "System architecture": 459 TFLOPs bf16; HBM 95 GiB,
    # 2765 GBps; bidirectional ICI 1200 GBps per chip; DCN 50 Gbps = 6.25 GB/s per chip;
    # 2 TensorCores per chip (v5p-128 is 64 chips).
    "v5p": ChipSpec(
        name="v5p",
        device_kind="TPU v5",
        hbm_bytes=95 * GiB,
        bf16_flops=459e12,
        hbm_bandwidth=2765e9,
        ici_bandwidth=1200e9,
        dcn_bandwidth=50e9 / 8,
        chip_axes=3,
        cores_per_chip=2,
        source="cloud.google.com/tpu/docs/v5p (System architecture)",
    ),
    # cloud.google.com/tpu/docs/v6e, "System architecture": 918 TFLOPs bf16; HBM 32 GB
    # (XLA: 32 GiB), 1640 GBps; bidirectional ICI 800 GBps per chip; data centre
    # network 25.6 Tbps per 256-chip pod (4 x 200 Gbps NICs per 8-chip host):
    # 100 Gbps = 12.5 GB/s per chip.
    "v6e": ChipSpec(
        name="v6e",
        device_kind="TPU v6 lite",
        hbm_bytes=32 * GiB,
        bf16_flops=918e12,
        hbm_bandwidth=1640e9,
        ici_bandwidth=800e9,
        dcn_bandwidth=100e9 / 8,
        chip_axes=2,
        cores_per_chip=1,
        source="cloud.google.com/tpu/docs/v6e (System architecture)",
    ),
    # NVIDIA H100 Tensor Core GPU datasheet, SXM5: 989 TFLOPS bf16 dense (1,979 with
    # sparsity); 80 GB HBM3 at 3.35 TB/s; NVLink 900 GB/s (both directions); a DGX H100
    # host's 8 GPUs each have a 400 Gb/s InfiniBand NIC: 50 GB/s between hosts. Memory:
    # 84,942,979,072 bytes, what XLA's description of the H100 SXM gives the compiler.
    "h100": ChipSpec(
        name="h100",
        device_kind="NVIDIA H100 80GB HBM3",
        hbm_bytes=84_942_979_072,
        bf16_flops=989e12,
        hbm_bandwidth=3.35e12,
        ici_bandwidth=900e9,
        dcn_bandwidth=400e9 / 8,
        chip_axes=1,
        cores_per_chip=1,
        source="NVIDIA H100 Tensor Core GPU datasheet (SXM5); DGX H100: 400 Gb/s a GPU",
        platform="gpu",
    ),
}

#: Other names Cloud TPU gives a generation (``v5litepod-16`` is a ``v5e-16``).
ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "trillium": "v6e"}


def chip(name: str) -> ChipSpec | None:
    """The chip of a generation name (``"v5e"``, an alias) or a ``device_kind``
    (``"TPU v5 lite"``); ``None`` for one not in ``CHIPS``.

    >>> chip("v5litepod").name, chip("TPU v6 lite").name, chip("cpu")
    ('v5e', 'v6e', None)
    """
    key = ALIASES.get(name.lower(), name.lower())
    if key in CHIPS:
        return CHIPS[key]
    kind = re.sub(r"\s+", " ", name.strip().lower())
    return next((c for c in CHIPS.values() if c.device_kind.lower() == kind), None)
