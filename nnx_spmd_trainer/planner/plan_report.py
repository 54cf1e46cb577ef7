"""What a plan costs before it runs: bytes per device, the compiler's memory and cost
figures, the collectives of the step, and whether it fits.

``Plan.report(batch_shapes)`` builds a ``PlanReport`` from shapes alone: nothing
is placed on the devices and no step runs.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from flax import nnx

from nnx_spmd_trainer.planner import flops, target_chips, target_report
from nnx_spmd_trainer.planner.hlo_runs import lines_with_runs
from nnx_spmd_trainer.planner.target import is_target
from nnx_spmd_trainer.sharding import path_str, shard_shape
from nnx_spmd_trainer.strategies import pipeline, sequence

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_INSTRUCTION = re.compile(r"=\s*(\([^=]*?\)|\S+)\s+(" + "|".join(COLLECTIVES) + r")(-start)?\(")
_ARRAY_TYPE = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1}

#: Memory bandwidth (bytes/s) of one device, by ``flops.device_name`` (vendor datasheets);
#: with ``flops.peak_flops`` (bf16) it bounds a step's time from its cost analysis.
MEMORY_BANDWIDTH: dict[str, float] = {
    "H100 SXM": 3.35e12,
    "H100 PCIe": 2.0e12,
    "H100 NVL": 3.9e12,
    "H200 SXM": 4.8e12,
    "H200 NVL": 4.8e12,
    "A100": 2.0e12,
    "B200": 8.0e12,
    "TPU v4": 1.2e12,
    "TPU v5e": 0.82e12,
    "TPU v5p": 2.76e12,
    "TPU v6e": 1.64e12,
}


def _itemsize(dtype: str) -> int:
    if dtype in _ITEMSIZE:
        return _ITEMSIZE[dtype]
    bits = re.search(r"(\d+)$", dtype)
    return int(bits.group(1)) // 8 if bits else 4


def collectives(hlo_text: str) -> dict[str, dict[str, int]]:
    """Count and result bytes of each collective one execution of compiled HLO text runs:
    an async ``-start``/``-done`` pair once, by its largest buffer; one in a loop's body
    as many times as the loop runs (``hlo_runs``: a scan over 12 layers, 12 times)."""
    found = {name: {"count": 0, "bytes": 0} for name in COLLECTIVES}
    hlo_text = re.sub(r"/\*.*?\*/", "", hlo_text)  # /*index=5*/ inside long tuple types
    for line, runs in lines_with_runs(hlo_text):
        if (match := _INSTRUCTION.search(line)) is None:
            continue
        types, name, started = match.groups()
        sizes = [
            _itemsize(dtype) * math.prod(int(d) for d in dims.split(",") if d)
            for dtype, dims in _ARRAY_TYPE.findall(types)
        ]
        found[name]["count"] += runs
        found[name]["bytes"] += runs * (max(sizes, default=0) if started else sum(sizes))
    return found


def _state_kind(path: str) -> str:
    root = path.split("/", 1)[0]
    return {"model": "parameters", "optimizer": "optimizer"}.get(root, "other")


def size(n: float) -> str:
    """Bytes for people: ``1.5 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def leaf_rows(targets: Any) -> list[dict[str, Any]]:
    """One row per state leaf: path, shape, dtype, spec, per-device shape and bytes."""
    rows = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(targets)[0]:
        sharding = leaf.sharding
        per_device = shard_shape(leaf.shape, sharding.spec, dict(sharding.mesh.shape))
        name = path_str(path)
        rows.append(
            {
                "path": name,
                "kind": _state_kind(name),
                "shape": list(leaf.shape),
                "dtype": str(leaf.dtype),
                "spec": str(sharding.spec),
                "shape_per_device": list(per_device),
                "bytes_per_device": math.prod(per_device) * leaf.dtype.itemsize,
            }
        )
    return rows


def _model_paths(plan: Any, which: nnx.filterlib.Filter) -> dict[str, int]:
    """``{"model/...": global size}`` of the plan's model leaves that ``which`` selects."""
    selected = nnx.to_flat_state(nnx.filter_state(plan.abstract_state["model"], which))
    return {path_str(("model", *p)): math.prod(v.shape) for p, v in selected}


def training_split(plan: Any, leaves: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """What trains and what is frozen (``nnx.Param`` s outside ``plan.wrt``: a LoRA run's
    base), its bytes per device, and the optimizer's: ``optimizer_copies`` is how many
    copies of each trainable byte it holds (Adam: 2), and ``full_optimizer_bytes`` what
    it would hold per device were every base parameter (every ``nnx.Param`` but LoRA
    adapters) trained alike, laid out as it is here."""
    trainable = _model_paths(plan, plan.wrt)
    params = _model_paths(plan, nnx.Param)
    base = _model_paths(plan, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))
    rows = {row["path"]: row for row in leaves}
    per_device = {p: rows[p]["bytes_per_device"] for p in params if p in rows}
    trainable_bytes = sum(per_device.get(p, 0) for p in trainable)
    own = {p.split("/", 1)[1]: rows[p]["shape"] for p in trainable if p in rows}
    optimizer = [row for row in leaves if row["kind"] == "optimizer"]

    def copies_a_trainable(row: Mapping[str, Any]) -> bool:  # opt_state/0/mu/<its path>
        parts = row["path"].split("/")
        tails = ("/".join(parts[k:]) for k in range(1, len(parts)))
        return any(own.get(tail) == row["shape"] for tail in tails)

    copies = sum(row["bytes_per_device"] for row in optimizer if copies_a_trainable(row))
    optimizer_bytes = sum(row["bytes_per_device"] for row in optimizer)
    ratio = copies / trainable_bytes if trainable_bytes else 0.0
    return {
        "trainable_parameters": sum(trainable.values()),
        "frozen_parameters": sum(n for p, n in params.items() if p not in trainable),
        "trainable_bytes": trainable_bytes,
        "frozen_bytes": sum(b for p, b in per_device.items() if p not in trainable),
        "optimizer_bytes": optimizer_bytes,
        "optimizer_copies": ratio,
        "full_optimizer_bytes": optimizer_bytes
        - copies
        + ratio * sum(per_device.get(p, 0) for p in base),
    }


def _training_lines(split: Mapping[str, float]) -> list[str]:
    """Two lines where some parameters are frozen (a LoRA run); none where all train."""
    if not split.get("frozen_parameters"):
        return []
    trained, frozen = split["trainable_parameters"], split["frozen_parameters"]
    share = 100 * trained / (trained + frozen)
    return [
        f"  trainable: {trained:,.0f} parameters ({share:.3g}% of {trained + frozen:,.0f}), "
        f"{size(split['trainable_bytes'])} per device; frozen: {frozen:,.0f}, "
        f"{size(split['frozen_bytes'])} per device",
        f"  optimizer per device: {size(split['optimizer_bytes'])} "
        f"({split['optimizer_copies']:.3g} copies of each trainable parameter); "
        f"full fine-tuning would hold about {size(split['full_optimizer_bytes'])}",
    ]


def layout_picture(row: Mapping[str, Any], mesh: Mapping[str, int]) -> str:
    """A text picture of how one leaf is cut over the mesh: each dimension and its axes."""
    spec = row["spec"]
    cuts = []
    for size, part in zip(row["shape"], row["shape_per_device"], strict=True):
        ways = size // part if part else 1
        cuts.append(f"{size} -> {part}" + (f" ({ways} ways)" if ways > 1 else " (whole)"))
    axes = " x ".join(f"{name}={size}" for name, size in mesh.items())
    return f"{row['path']} {spec} on mesh [{axes}]: " + ", ".join(cuts)


def _budget_line(peak: int, budget: int | None) -> tuple[bool | None, str]:
    if budget is None:
        return None, "device memory unknown here: give memory_budget_bytes to check the fit"
    if peak <= budget:
        return True, f"fits: a peak of {size(peak)} of {size(budget)} per device"
    return False, f"does not fit: {size(peak - budget)} over {size(budget)} per device"


@dataclasses.dataclass(frozen=True)
class PlanReport:
    """The cost of a planned train step, per device; prints as a table, ``to_dict()`` is JSON.

    Attributes:
      strategy, mesh: the layout.
      leaves: one row per state leaf (``leaf_rows``).
      memory: the compiled step's ``memory_analysis()`` per device, and ``peak``:
        arguments + outputs - aliased + temporaries + generated code.
      budget_bytes, fits, verdict: the per-device memory checked against
        (``memory_budget_bytes``, else the device's own limit where reported).
      collectives: count and bytes of each collective in the compiled HLO.
      flops, bytes_accessed: per step and device: the FLOPs of the step's matrix
        multiplies, counted from its jaxpr (each scanned layer: XLA's ``cost_analysis()``
        counts a loop's body once), and the bytes from ``cost_analysis()``.
      step_time_bound_s: where the hardware is known, the larger of FLOPs over
        peak FLOP/s and bytes over bandwidth; ``None`` elsewhere (the CPU).
      suggestions: what to try when it does not fit.
      pipeline: under ``PipelineParallel``, its stages, layers per stage,
        microbatches, bubble fraction and stacked bytes per device; else ``""``.
      sequence: under ``SequenceParallel``, the attention form in force (all-gather
        or ring) and the count of the collective carrying keys and values (the ring's
        also how its blocks ran: cuDNN's fused kernel or einsums); else ``""``.
      training: trainable and frozen parameters, their bytes per device and the
        optimizer's, next to what full fine-tuning's optimizer would hold
        (``training_split``); printed where some parameters are frozen (LoRA).
      target: on TPU chips, the chip's table row, the collectives split into those
        inside a slice (ICI) and across slices (DCN), and a roofline step time and
        the MFU it allows (``target_report.figures``); ``{}`` elsewhere.
      notes: lines the caller adds (``Plan.report(notes=)``): a post-training trainer's
        log-probabilities read from the whole logits, say.
    """

    strategy: str
    mesh: dict[str, int]
    leaves: list[dict[str, Any]]
    memory: dict[str, int]
    budget_bytes: int | None
    fits: bool | None
    verdict: str
    collectives: dict[str, dict[str, int]]
    flops: float
    bytes_accessed: float
    device_kind: str
    step_time_bound_s: float | None
    suggestions: list[str]
    picture: str
    pipeline: str = ""
    sequence: str = ""
    training: dict[str, float] = dataclasses.field(default_factory=dict)
    target: dict[str, Any] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)

    def bytes_per_device(self, kind: str) -> int:
        """State bytes one device holds: ``"parameters"``, ``"optimizer"`` or ``"other"``."""
        return sum(row["bytes_per_device"] for row in self.leaves if row["kind"] == kind)

    def to_dict(self) -> dict[str, Any]:
        totals = {k: self.bytes_per_device(k) for k in ("parameters", "optimizer", "other")}
        return {**dataclasses.asdict(self), "state_bytes_per_device": totals}

    def __str__(self) -> str:
        lines = [f"plan: {self.strategy} on mesh {self.mesh} ({self.device_kind})"]
        width = max([len(row["path"]) for row in self.leaves] + [4])
        lines.append(f"  {'leaf':<{width}}  {'shape':<18} {'spec':<28} per device")
        for row in self.leaves:
            shape = "x".join(map(str, row["shape"])) or "()"
            local = "x".join(map(str, row["shape_per_device"])) or "()"
            lines.append(
                f"  {row['path']:<{width}}  {shape:<18} {row['spec']:<28} {local} "
                f"{size(row['bytes_per_device'])}"
            )
        lines.append(
            "  state per device: "
            + ", ".join(
                f"{k} {size(self.bytes_per_device(k))}"
                for k in ("parameters", "optimizer", "other")
            )
        )
        lines.extend(_training_lines(self.training))
        memory = ", ".join(f"{k} {size(v)}" for k, v in self.memory.items())
        lines.append(f"  compiled step per device: {memory}")
        lines.append(f"  {self.verdict}")
        lines.extend(f"    try: {s}" for s in self.suggestions)
        used = {k: v for k, v in self.collectives.items() if v["count"]}
        lines.append(
            "  collectives: "
            + (", ".join(f"{k} x{v['count']} ({size(v['bytes'])})" for k, v in used.items())
               or "none")
        )  # fmt: skip
        bound = (
            f", step time >= {self.step_time_bound_s * 1e3:.3f} ms"
            if self.step_time_bound_s is not None
            else ""
        )
        devices = math.prod(self.mesh.values())
        over = f"{self.flops * devices:.3g} on {devices} device{'s' if devices != 1 else ''}"
        lines.append(
            f"  per step and device: {self.flops:.3g} FLOPs ({over}), "
            f"{self.bytes_accessed:.3g} bytes{bound}"
        )
        lines.extend(target_report.lines(self.target, size))
        lines.append(f"  layout of the largest leaf: {self.picture}")
        lines.extend(f"  {line}" for line in (self.pipeline, self.sequence) if line)
        lines.extend(f"  note: {note}" for note in self.notes)
        return "\n".join(lines)


def _cost(compiled: Any) -> dict[str, float]:
    cost = compiled.cost_analysis()
    if isinstance(cost, Sequence):  # a one-element list on some versions
        cost = cost[0] if cost else {}
    return dict(cost or {})


def _cost_counted_here(compiled: Any) -> dict[str, float]:
    """XLA's cost analysis of ``compiled``'s partitioned program (one device's), by the
    CPU backend: for a compiler that gives none (XLA's GPU compiler for GPUs described,
    not present). ``{}`` where it cannot be counted (jax's private API moved; no CPU
    backend)."""
    try:
        from jax._src.lib import _jax

        (module, *_) = compiled.runtime_executable().hlo_modules()
        cpu = jax.local_devices(backend="cpu")[0].client
        return dict(_jax.hlo_module_cost_analysis(cpu, module))
    except Exception:  # noqa: BLE001  a private API: no count rather than no report
        return {}


def _device_limit(devices: Sequence[jax.Device]) -> int | None:
    """The smallest memory limit the backend reports for this process's ``devices``.

    Another process's devices cannot be asked (PjRt: "MemoryStats is only supported for
    addressable devices"), so each process reads its own; processes on the same hardware
    read the same limit, and a job spans one kind of hardware. Chips described, not
    present (a ``Target``'s), cannot be asked at all: their HBM is the chip table's."""
    if devices and is_target(devices):
        spec = target_chips.chip(devices[0].device_kind)
        return spec.hbm_bytes if spec is not None else None
    here = jax.process_index()
    limits = [
        int(stats["bytes_limit"])
        for device in devices
        if device.process_index == here
        and (stats := device.memory_stats())
        and "bytes_limit" in stats
    ]
    return min(limits, default=None)


def suggestions(mesh: Mapping[str, int], grad_accum_steps: int) -> list[str]:
    """What usually makes a step fit, in the order worth trying."""
    names = set(mesh)
    tips = []
    if "fsdp" not in names:
        tips.append("FSDP(): shard parameters, gradients and optimizer state over the devices")
    if "model" not in names:
        tips.append(
            "Hybrid(FSDP(n), TensorParallel(k)) with a k the model's annotated dimensions divide"
        )
    tips.append(
        f"gradient accumulation (grad_accum_steps={grad_accum_steps * 2}): half the activations"
    )
    tips.append("a smaller global batch")
    return tips


def build(
    plan: Any,
    compiled: Any,
    *,
    memory_budget_bytes: int | None = None,
    matmul_flops: float | None = None,
) -> PlanReport:
    """The report of ``plan``'s compiled train step (``plan.lower(shapes).compile()``);
    ``matmul_flops``: its matrix multiplies' FLOPs per device, counted from its jaxpr
    (``flop_count``), the FLOPs reported where given (else the compiler's count)."""
    leaves = leaf_rows(plan.state_targets())
    analysis = compiled.memory_analysis()
    memory = {
        "arguments": int(analysis.argument_size_in_bytes),
        "outputs": int(analysis.output_size_in_bytes),
        "aliased": int(analysis.alias_size_in_bytes),
        "temporaries": int(analysis.temp_size_in_bytes),
        "generated_code": int(analysis.generated_code_size_in_bytes),
    }
    memory["peak"] = (
        memory["arguments"]
        + memory["outputs"]
        - memory["aliased"]
        + memory["temporaries"]
        + memory["generated_code"]
    )
    devices = list(plan.mesh.devices.flat)
    budget = memory_budget_bytes if memory_budget_bytes is not None else _device_limit(devices)
    fits, verdict = _budget_line(memory["peak"], budget)
    cost = _cost(compiled)
    notes = []
    if not cost.get("bytes accessed") and (counted_here := _cost_counted_here(compiled)):
        cost = counted_here
        notes.append(
            "the compiler gives no cost analysis for these devices: the bytes accessed "
            "are XLA's count of the compiled program (one device's), made by the CPU backend"
        )
    if matmul_flops:
        cost["flops"] = matmul_flops
    kind = devices[0].device_kind if devices else "?"
    name, flops_per_s = flops.device_name(kind), flops.peak_flops(kind)
    bound = None
    if name in MEMORY_BANDWIDTH and flops_per_s is not None:
        bandwidth = MEMORY_BANDWIDTH[name]
        bound = max(
            cost.get("flops", 0.0) / flops_per_s, cost.get("bytes accessed", 0.0) / bandwidth
        )
    mesh = {str(k): int(v) for k, v in plan.mesh.shape.items()}
    largest = max(leaves, key=lambda row: math.prod(row["shape"]))
    hlo = compiled.as_text()
    counted = collectives(hlo)
    target = target_report.figures(devices, hlo, cost)
    if target:  # TPU chips: the roofline counts the interconnects too
        bound = target["roofline"]["bound_s"]
    return PlanReport(
        strategy=repr(plan.strategy),
        mesh=mesh,
        leaves=leaves,
        memory=memory,
        budget_bytes=budget,
        fits=fits,
        verdict=verdict,
        collectives=counted,
        flops=float(cost.get("flops", 0.0)),
        bytes_accessed=float(cost.get("bytes accessed", 0.0)),
        device_kind=kind,
        step_time_bound_s=bound,
        suggestions=suggestions(mesh, plan.grad_accum_steps) if fits is False else [],
        picture=layout_picture(largest, mesh),
        pipeline=pipeline.report_line(plan.strategy, plan.mesh, plan.state_targets()),
        sequence=sequence.report_line(plan.strategy, plan.mesh, counted, hlo),
        training=training_split(plan, leaves),
        target=target,
        notes=notes,
    )


def compiled_report(
    plan: Any,
    lowered: Any,
    *,
    memory_budget_bytes: int | None = None,
    matmul_flops: float | None = None,
) -> PlanReport:
    """``build`` of ``lowered.compile()``; where the compiler itself refuses for want
    of memory (the TPU compiler's ``RESOURCE_EXHAUSTED``), that verdict, with its bytes,
    as a report that does not fit."""
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as error:
        refused = target_report.refusal(error)
        if refused is None:
            raise
        return refusal_report(plan, refused)
    return build(plan, compiled, memory_budget_bytes=memory_budget_bytes, matmul_flops=matmul_flops)


def refusal_report(plan: Any, refused: Mapping[str, Any]) -> PlanReport:
    """The report of a step the compiler refused: the state's leaves, the bytes it
    needed against the HBM it had, no cost (nothing was compiled)."""
    leaves = leaf_rows(plan.state_targets())
    mesh = {str(k): int(v) for k, v in plan.mesh.shape.items()}
    devices = list(plan.mesh.devices.flat)
    needed, available = refused["needed"], refused["available"]
    verdict = (
        f"does not fit: the compiler refused: {refused['what']} need {size(needed)}, "
        f"{size(available)} of HBM available per chip ({size(needed - available)} over)"
    )
    return PlanReport(
        strategy=repr(plan.strategy), mesh=mesh, leaves=leaves,
        memory={"peak": int(needed)}, budget_bytes=int(available), fits=False,
        verdict=verdict, collectives={n: {"count": 0, "bytes": 0} for n in COLLECTIVES},
        flops=0.0, bytes_accessed=0.0, device_kind=devices[0].device_kind,
        step_time_bound_s=None, suggestions=suggestions(mesh, plan.grad_accum_steps),
        picture=layout_picture(max(leaves, key=lambda r: math.prod(r["shape"])), mesh),
        training=training_split(plan, leaves),
        target=target_report.figures(devices, None, {}),
    )  # fmt: skip
