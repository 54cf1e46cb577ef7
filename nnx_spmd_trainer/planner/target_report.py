"""A plan's figures for TPU chips, from the compiled step and the chip table: the HBM a
chip has, the collectives inside a slice (ICI) and across slices (DCN), a roofline step
time and the utilisation it allows; and the compiler's refusal read as a verdict.

``plan_report.build`` asks ``figures`` for every plan on TPU chips (present or a
``Target``'s) and ``refusal`` when the TPU compiler ran out of HBM.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from nnx_spmd_trainer.planner.hlo_runs import lines_with_runs
from nnx_spmd_trainer.planner.target import slice_of
from nnx_spmd_trainer.planner.target_chips import ChipSpec, chip

_COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_LINE = re.compile(
    r"=\s*(?P<types>\([^=]*?\)|\S+)\s+(?P<op>" + "|".join(_COLLECTIVES) + r")(?P<start>-start)?\("
)
_ARRAY_TYPE = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]")
#: A transfer across slices: the TPU compiler lowers a collective over the data-centre
#: network (Megascale) to a host-transfer ``send``/``recv`` pair tagged with its kind.
_DCN_SEND = re.compile(
    r"=\s*(?P<types>\([^=]*?\)|\S+)\s+send\(.*_xla_megascale_transfer_type=\"(?P<kind>[A-Z_]+)\""
)
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1}


def _itemsize(dtype: str) -> int:
    if dtype in _ITEMSIZE:
        return _ITEMSIZE[dtype]
    bits = re.search(r"(\d+)$", dtype)
    return int(bits.group(1)) // 8 if bits else 4


def _ints(text: str) -> list[int]:
    return [int(n) for n in text.split(",") if n]


def _bytes_of(types: str) -> list[int]:
    return [_itemsize(dtype) * math.prod(_ints(dims)) for dtype, dims in _ARRAY_TYPE.findall(types)]


def split_by_link(hlo_text: str) -> dict[str, dict[str, int]]:
    """Count and bytes, per chip, of the collectives inside a slice (``"ici"``: the
    program's own collectives, an async ``-start``/``-done`` pair once, by its largest
    buffer) and across slices (``"dcn"``: on several slices the compiler gives each
    slice its own program, and what crosses slices is a Megascale ``send``; its bytes
    are the buffer sent).

    >>> hlo = [
    ...     "a = f32[256]{0} all-reduce(x), replica_groups={{0,1}}",
    ...     'b = (f32[64]{0}, token[]) send(y, t), _xla_megascale_transfer_type="ALL_REDUCE"',
    ... ]
    >>> split_by_link(chr(10).join(hlo))
    {'ici': {'count': 1, 'bytes': 1024}, 'dcn': {'count': 1, 'bytes': 256}}
    """
    found = {"ici": {"count": 0, "bytes": 0}, "dcn": {"count": 0, "bytes": 0}}
    hlo_text = re.sub(r"/\*.*?\*/", "", hlo_text)
    for line, runs in lines_with_runs(hlo_text):  # a loop's body: as often as it runs
        if (match := _LINE.search(line)) is not None:
            sizes = _bytes_of(match["types"])
            link = found["ici"]
            link["bytes"] += runs * (max(sizes, default=0) if match["start"] else sum(sizes))
        elif (send := _DCN_SEND.search(line)) is not None:
            link = found["dcn"]
            link["bytes"] += runs * max(_bytes_of(send["types"]), default=0)
        else:
            continue
        link["count"] += runs
    return found


def roofline(
    spec: ChipSpec, flops: float, hbm_bytes: float, links: Mapping[str, Mapping[str, int]]
) -> dict[str, float]:
    """Seconds each resource needs for one step on one chip, the bound (the largest:
    the step cannot be faster, even with every transfer hidden behind compute) and the
    model FLOPs utilisation that bound allows (compute time over the bound)."""
    times = {
        "compute_s": flops / spec.bf16_flops,
        "hbm_s": hbm_bytes / spec.hbm_bandwidth,
        "ici_s": links["ici"]["bytes"] / spec.ici_bandwidth,
        "dcn_s": links["dcn"]["bytes"] / spec.dcn_bandwidth,
    }
    bound = max(times.values())
    return {**times, "bound_s": bound, "mfu": times["compute_s"] / bound if bound else 0.0}


def figures(
    devices: Sequence[jax.Device], hlo_text: str | None, cost: Mapping[str, float]
) -> dict[str, Any]:
    """The chip's figures for a plan on TPU ``devices`` (``{}`` for other devices):
    its table row, the ICI/DCN split of the step's collectives and the roofline."""
    spec = chip(devices[0].device_kind) if devices else None
    if spec is None:
        return {}
    slices = len({slice_of(d) for d in devices})
    links = (
        split_by_link(hlo_text)
        if hlo_text is not None
        else {"ici": {"count": 0, "bytes": 0}, "dcn": {"count": 0, "bytes": 0}}
    )
    times = roofline(spec, cost.get("flops", 0.0), cost.get("bytes accessed", 0.0), links)
    return {
        "chip": spec.name,
        "platform": spec.platform,
        "chips": len(devices),
        "slices": slices,
        "hbm_bytes": spec.hbm_bytes,
        "peaks": {
            "bf16_flops": spec.bf16_flops,
            "hbm_bandwidth": spec.hbm_bandwidth,
            "ici_bandwidth": spec.ici_bandwidth,
            "dcn_bandwidth": spec.dcn_bandwidth,
        },
        "source": spec.source,
        "links": links,
        "roofline": times if hlo_text is not None else {},
        # GPUs over several hosts: one program, its collectives' groups not read for
        # which cross a host (TPU slices get their own programs and sends).
        "links_note": (
            "collectives are not split by host for GPUs: all are counted under NVLink"
            if spec.platform == "gpu" and slices > 1
            else ""
        ),
    }


def lines(target: Mapping[str, Any], size: Any) -> list[str]:
    """The report's lines for ``figures``' answer (none for ``{}``)."""
    if not target:
        return []
    peaks = target["peaks"]
    # A GPU's "slice" is its host: NVLink inside, the network between.
    group, ici, dcn = (
        ("host", "NVLink", "network")
        if target.get("platform") == "gpu"
        else ("slice", "ICI", "DCN")
    )
    out = [
        f"  target: {target['chips']} {target['chip']} chips in {target['slices']} "
        f"{group}{'s' if target['slices'] > 1 else ''}; per chip {size(target['hbm_bytes'])} "
        f"HBM, {peaks['bf16_flops'] / 1e12:.0f} TFLOP/s bf16, HBM "
        f"{peaks['hbm_bandwidth'] / 1e9:.0f} GB/s, {ici} {peaks['ici_bandwidth'] / 1e9:.0f} "
        f"GB/s, {dcn} {peaks['dcn_bandwidth'] / 1e9:.3g} GB/s ({target['source']})"
    ]
    links = target["links"]
    out.append(
        f"  collectives per chip: inside a {group} ({ici}) "
        f"x{links['ici']['count']} {size(links['ici']['bytes'])}, across {group}s ({dcn}) "
        f"x{links['dcn']['count']} {size(links['dcn']['bytes'])}"
        + (f" ({target['links_note']})" if target.get("links_note") else "")
    )
    times = target["roofline"]
    if times:
        out.append(
            f"  roofline per step: compute {times['compute_s'] * 1e3:.3g} ms, HBM "
            f"{times['hbm_s'] * 1e3:.3g} ms, {ici} {times['ici_s'] * 1e3:.3g} ms, {dcn} "
            f"{times['dcn_s'] * 1e3:.3g} ms: step time >= {times['bound_s'] * 1e3:.3g} ms, "
            f"MFU <= {100 * times['mfu']:.1f}%"
        )
    return out


#: The TPU compiler's out-of-memory refusal, and the figures it gives.
_REFUSED = re.compile(r"RESOURCE_EXHAUSTED", re.IGNORECASE)
_HUMAN = r"([0-9.]+)([KMGT]?)i?B?"
_EXCEEDS = re.compile(r"\(" + _HUMAN + r"\)\s*exceeds available HBM\s*\(" + _HUMAN + r"\)")
_WHAT = re.compile(r"required for ([A-Za-z ]+?) \(")
_USED = re.compile(r"Used " + _HUMAN + r" of " + _HUMAN + r" hbm")


def _bytes(number: str, unit: str) -> int:
    return int(float(number) * 1024 ** " KMGT".index(unit or " "))


def refusal(error: BaseException) -> dict[str, Any] | None:
    """What the TPU compiler's ``RESOURCE_EXHAUSTED`` says: the bytes it needed and the
    HBM it had (``None`` for any other error, or one without figures)."""
    text = str(error)
    if not _REFUSED.search(text):
        return None
    used = _USED.search(text)
    if used:
        needed, available = _bytes(used[1], used[2]), _bytes(used[3], used[4])
        what = "the program"
    else:
        exceeds = _EXCEEDS.search(text)
        if exceeds is None:
            return None
        needed, available = _bytes(exceeds[1], exceeds[2]), _bytes(exceeds[3], exceeds[4])
        named = _WHAT.search(text)
        what = named[1] if named else "the program"
    first = next((line for line in text.splitlines() if _REFUSED.search(line)), text)
    return {"needed": needed, "available": available, "what": what, "message": first[:400]}
