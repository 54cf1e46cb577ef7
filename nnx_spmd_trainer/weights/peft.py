"""LoRA adapters in and out of a PEFT adapter directory (``adapter_config.json`` +
``adapter_model.safetensors``), the names and shapes Hugging Face's ``peft`` reads.

A PEFT LoRA module ``M`` holds ``base_model.model.M.lora_A.weight`` ``[r, in]`` and
``base_model.model.M.lora_B.weight`` ``[out, r]``; its update to the base is
``scaling * B @ A`` with ``scaling = lora_alpha / r`` (per module: ``rank_pattern``,
``alpha_pattern``). The library's adapters are ``lora_a`` ``[in, r]`` and ``lora_b``
``[r, out]`` beside a kernel ``[in, out]`` (``[layers, in, out]`` when stacked).

Where a kernel sits in the file is read from the model's ``WeightMap`` (the map that
loads and exports the base) by a probe: the kernel is filled with its own element
numbers and exported through the map, so every file position knows the kernel
element it came from, whatever the map does (transpose, split, stack). Kernels that
feed one file tensor (GPT-2's q, k, v in the fused ``c_attn``) become one PEFT module
whose rank is their ranks added (A stacked, B block-diagonal) and whose alpha is
scaled alike, so ``lora_alpha / r`` and the update are unchanged and exact.

>>> import numpy as np
>>> from nnx_spmd_trainer.weights import WeightMap, tensor, transpose
>>> m = WeightMap({"fc/kernel": transpose(tensor("fc.weight", (3, 2)), (1, 0))})
>>> a, b = np.ones((2, 1), np.float32), np.ones((1, 3), np.float32)
>>> adapter = peft_adapter({"fc/kernel": (a, b)}, m, rank=1, alpha=2.0)
>>> sorted((k, v.shape) for k, v in adapter.tensors.items())
[('base_model.model.fc.lora_A.weight', (1, 2)), ('base_model.model.fc.lora_B.weight', (3, 1))]
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nnx_spmd_trainer.data.to_host import gather_to_host
from nnx_spmd_trainer.data.written import PARTIAL, write_errors
from nnx_spmd_trainer.weights.expr import Piece, Tensor, full_index
from nnx_spmd_trainer.weights.mapping import WeightMap

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "PeftAdapter",
    "adapter_arrays",
    "file_layout",
    "peft_adapter",
    "read_peft_adapter",
    "write_peft_adapter",
]

#: PEFT's file names (``peft.utils.CONFIG_NAME``, ``SAFETENSORS_WEIGHTS_NAME``).
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: The prefix ``PeftModel.save_pretrained`` gives every tensor name.
PREFIX = "base_model.model."
_A, _B = ".lora_A.weight", ".lora_B.weight"

#: One library adapter: ``lora_a`` ``[(layers,) in, r]`` and ``lora_b`` ``[(layers,) r, out]``.
LoraPair = tuple[Any, ...]


@dataclass(frozen=True)
class PeftAdapter:
    """A PEFT LoRA adapter: its ``adapter_config.json`` as a dict and its tensors by name.

    >>> a = PeftAdapter({"peft_type": "LORA", "r": 2, "lora_alpha": 4},
    ...                 {"base_model.model.fc.lora_A.weight": np.zeros((2, 3)),
    ...                  "base_model.model.fc.lora_B.weight": np.zeros((5, 2))})
    >>> a.modules(), a.scaling("fc")
    (['fc'], 2.0)
    """

    config: dict[str, Any]
    tensors: dict[str, np.ndarray] = field(repr=False)

    def modules(self) -> list[str]:
        """The adapted modules' names (``transformer.h.0.attn.c_attn``), sorted."""
        return sorted(name[len(PREFIX) : -len(_A)] for name in self.tensors if name.endswith(_A))

    def pair(self, module: str) -> tuple[np.ndarray, np.ndarray]:
        """``(lora_A [r, in], lora_B [out, r])`` of ``module``."""
        return self.tensors[PREFIX + module + _A], self.tensors[PREFIX + module + _B]

    def rank(self, module: str) -> int:
        return int(_pattern(self.config.get("rank_pattern"), module, self.config["r"]))

    def scaling(self, module: str) -> float:
        """``lora_alpha / r`` of ``module`` (``/ sqrt(r)`` with ``use_rslora``), as PEFT."""
        alpha = float(_pattern(self.config.get("alpha_pattern"), module, self.config["lora_alpha"]))
        rank = self.rank(module)
        return alpha / (math.sqrt(rank) if self.config.get("use_rslora") else rank)


def _pattern(patterns: Mapping[str, Any] | None, module: str, default: Any) -> Any:
    """PEFT's ``get_pattern_key``: the first key matching the end of ``module``."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


@dataclass(frozen=True)
class _Place:
    """Where one kernel lands in one file tensor: per file ``in`` index, the kernel's
    ``in`` index (-1: not this kernel's); per file ``out`` index, its ``out`` index; the
    stacked layer (0 unstacked)."""

    module: str
    layer: int
    in_index: np.ndarray
    out_index: np.ndarray
    file_shape: tuple[int, int]  # (in, out)


def _places(weight_map: WeightMap, path: str, shape: tuple[int, ...], fan_in_fan_out: bool):
    """The probe: ``path``'s kernel numbered element by element, exported through the map."""
    expr = weight_map.targets.get(path)
    if expr is None:
        raise ValueError(
            f"{path}: the weight map has no entry for this kernel; adapters are "
            f"exported beside a mapped kernel ({sorted(weight_map.targets)[:4]}...)."
        )
    ids = np.arange(math.prod(shape)).reshape(shape)
    declared = weight_map.sources()
    whole = Piece(Tensor(path, shape, np.dtype(np.int64)), (0,) * len(shape))
    out: list[_Place] = []
    for name, piece in expr.invert(whole):
        if not name.endswith(".weight") or len(declared[name].shape) != 2:
            raise ValueError(f"{path} is written to {name}, not a 2-D '.weight': no LoRA module.")
        block = piece.value.read(full_index(piece.value.shape), {path: ids})
        coords = np.unravel_index(block, shape)  # per file element: (layer?, in, out)
        layer = int(coords[0].flat[0]) if len(shape) == 3 else 0
        k_in, k_out = coords[-2], coords[-1]
        if not fan_in_fan_out:  # a Linear's file is [out, in]
            k_in, k_out, at = k_in.T, k_out.T, piece.at[::-1]
        else:
            at = piece.at
        file_in, file_out = declared[name].shape if fan_in_fan_out else declared[name].shape[::-1]
        in_index = np.full(file_in, -1)
        out_index = np.full(file_out, -1)
        in_index[at[0] : at[0] + k_in.shape[0]] = k_in[:, 0]
        out_index[at[1] : at[1] + k_out.shape[1]] = k_out[0, :]
        if not ((k_in == k_in[:, :1]).all() and (k_out == k_out[:1, :]).all()):
            raise ValueError(
                f"{path} is not laid out in {name} as rows by columns: no LoRA module."
            )
        out.append(_Place(name[: -len(".weight")], layer, in_index, out_index, (file_in, file_out)))
    return out


def _in_by_out(weight_map: WeightMap, path: str, shape: tuple[int, ...]) -> bool | None:
    """Whether the map writes ``path``'s kernel ``[in, out]`` into its file (a ``Conv1D``)
    rather than ``[out, in]`` (a ``Linear``); ``None`` where either reads alike (1 x 1)."""
    expr = weight_map.targets.get(path)
    if expr is None:
        return None  # _places names the missing entry
    ids = np.arange(math.prod(shape)).reshape(shape)
    whole = Piece(Tensor(path, shape, np.dtype(np.int64)), (0,) * len(shape))
    for _, piece in expr.invert(whole):
        block = piece.value.read(full_index(piece.value.shape), {path: ids})
        if block.ndim != 2:
            return None  # _places refuses it
        k_in, k_out = np.unravel_index(block, shape)[-2:]
        rows = bool((k_in == k_in[:, :1]).all() and (k_out == k_out[:1, :]).all())
        columns = bool((k_in == k_in[:1, :]).all() and (k_out == k_out[:, :1]).all())
        if rows != columns:
            return rows
    return None


def file_layout(weight_map: WeightMap, kernels: Mapping[str, tuple[int, ...]]) -> bool:
    """PEFT's ``fan_in_fan_out`` for adapters beside ``kernels`` (path -> shape), read
    from the map: ``True`` where its files hold the kernels ``[in, out]`` (GPT-2's
    ``Conv1D``), ``False`` where ``[out, in]`` (a ``Linear``: the map transposes).

    >>> from nnx_spmd_trainer.weights import WeightMap, tensor, transpose
    >>> linear = WeightMap({"fc/kernel": transpose(tensor("fc.weight", (3, 2)), (1, 0))})
    >>> conv1d = WeightMap({"fc/kernel": tensor("fc.weight", (2, 3))})
    >>> file_layout(linear, {"fc/kernel": (2, 3)}), file_layout(conv1d, {"fc/kernel": (2, 3)})
    (False, True)
    """
    found = {path: _in_by_out(weight_map, path, tuple(shape)) for path, shape in kernels.items()}
    layouts = {layout for layout in found.values() if layout is not None}
    if len(layouts) > 1:
        conv = sorted(p for p, layout in found.items() if layout)[:2]
        linear = sorted(p for p, layout in found.items() if layout is False)[:2]
        raise ValueError(
            f"The weight map writes some adapted kernels [in, out] ({', '.join(conv)}) and "
            f"others [out, in] ({', '.join(linear)}); a PEFT adapter has one fan_in_fan_out: "
            "export them as two adapters, or pass fan_in_fan_out= to choose."
        )
    return layouts.pop() if layouts else False


def _module_prefix(weight_map: WeightMap) -> str:
    """The map's first ``prefixes`` entry: the names of the model class that saves the
    file with it (``GPT2LMHeadModel``'s ``"transformer."``), which ``peft`` wraps."""
    return weight_map.prefixes[0] if weight_map.prefixes else ""


def _groups(
    kernels: Mapping[str, tuple[int, ...]], weight_map: WeightMap, fan_in_fan_out: bool
) -> dict[str, list[tuple[str, _Place]]]:
    """Module -> the kernel places that feed it, ordered by where their outputs start."""
    groups: dict[str, list[tuple[str, _Place]]] = {}
    for path, shape in kernels.items():
        for place in _places(weight_map, path, tuple(shape), fan_in_fan_out):
            groups.setdefault(place.module, []).append((path, place))
    for places in groups.values():
        places.sort(key=lambda item: int(np.argmax(item[1].out_index >= 0)))
    return groups


def peft_adapter(
    adapters: Mapping[str, LoraPair],
    weight_map: WeightMap,
    *,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    fan_in_fan_out: bool | None = None,
    module_prefix: str | None = None,
    base_model_name_or_path: str | None = None,
    task_type: str = "CAUSAL_LM",
) -> PeftAdapter:
    """The PEFT adapter of the library's adapters.

    Args:
      adapters: kernel path (``"h/0/attn/q/kernel"``, the map's key) -> ``(lora_a,
        lora_b)`` (or a tuple starting so: ``nn.lora.adapters``'s), the update being
        ``alpha / rank * lora_a @ lora_b``; sharded arrays are gathered (with several
        processes, every process calls this).
      weight_map: the map the base loads and exports through.
      rank, alpha, dropout: the adapters' (``lora_alpha = alpha``).
      fan_in_fan_out: the file stores ``[in, out]`` (GPT-2's ``Conv1D``); else
        ``[out, in]`` (``nn.Linear``); ``None``: read from the map (``file_layout``).
      module_prefix: put before the file's names to make the module names of the
        model ``peft`` wraps (``"transformer."`` for ``GPT2LMHeadModel``); ``None``: the
        map's first ``prefixes`` entry (``gpt2_weight_map``'s ``"transformer."``), else none.
      base_model_name_or_path, task_type: written to the config for ``peft``.
    """
    shapes = {p: (*np.shape(pair[0])[:-1], np.shape(pair[1])[-1]) for p, pair in adapters.items()}
    if fan_in_fan_out is None:
        fan_in_fan_out = file_layout(weight_map, shapes)
    if module_prefix is None:
        module_prefix = _module_prefix(weight_map)
    tensors: dict[str, np.ndarray] = {}
    rank_pattern: dict[str, int] = {}
    alpha_pattern: dict[str, float] = {}
    for module, places in _groups(shapes, weight_map, fan_in_fan_out).items():
        name = module_prefix + module
        file_in, file_out = places[0][1].file_shape
        total = rank * len(places)
        lora_A = np.zeros((total, file_in), np.float32)
        lora_B = np.zeros((file_out, total), np.float32)
        for k, (path, place) in enumerate(places):
            # several processes: every one gathers the same arrays in the same order
            a, b = (np.asarray(x, np.float32) for x in gather_to_host(adapters[path][:2]))
            if a.ndim == 3:
                a, b = a[place.layer], b[place.layer]
            ranks = slice(k * rank, (k + 1) * rank)
            rows, cols = place.in_index >= 0, place.out_index >= 0
            lora_A[ranks, rows] = a[place.in_index[rows]].T
            lora_B[cols, ranks] = b[:, place.out_index[cols]].T
        tensors[PREFIX + name + _A], tensors[PREFIX + name + _B] = lora_A, lora_B
        if len(places) > 1:  # a fused module: rank and alpha grow together, scaling kept
            rank_pattern[name], alpha_pattern[name] = total, alpha * len(places)
    config = {
        "peft_type": "LORA",
        "task_type": task_type,
        "base_model_name_or_path": base_model_name_or_path,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": PeftAdapter({}, tensors).modules(),
        "fan_in_fan_out": fan_in_fan_out,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    return PeftAdapter(config, tensors)


def adapter_arrays(
    adapter: PeftAdapter,
    weight_map: WeightMap,
    kernels: Mapping[str, tuple[int, ...]],
    *,
    rank: int,
    alpha: float,
    module_prefix: str | None = None,
) -> dict[str, LoraPair]:
    """The library's adapters (``peft_adapter`` read backwards) for ``kernels`` (kernel
    path -> its shape) of rank ``rank`` and scale ``alpha / rank``. A module adapted by
    PEFT itself (rank ``r`` for a fused ``c_attn``) gives each kernel a copy of its A.
    ``module_prefix``: put before the file's names to make the adapter's module names;
    ``None``: each name looked up as it is, then with each of the map's ``prefixes``
    (an adapter of ``GPT2LMHeadModel`` and one of ``GPT2Model`` alike)."""
    fan_in_fan_out = bool(adapter.config.get("fan_in_fan_out", False))
    known = set(adapter.modules())
    prefixes = ("", *weight_map.prefixes) if module_prefix is None else (module_prefix,)
    out: dict[str, list[np.ndarray]] = {}
    for module, places in _groups(kernels, weight_map, fan_in_fan_out).items():
        names = [p + module for p in prefixes]
        name = next((n for n in names if n in known), names[-1])
        if name not in known:
            raise ValueError(
                f"{name}: no LoRA module of that name in the adapter ({sorted(known)[:4]})."
            )
        lora_A, lora_B = adapter.pair(name)
        total = adapter.rank(name)
        if total not in (rank, rank * len(places)):
            raise ValueError(f"{name} has rank {total}: expected {rank} or {rank * len(places)}.")
        ratio = adapter.scaling(name) / (alpha / rank)  # fold a different scale into B
        for k, (path, place) in enumerate(places):
            ranks = slice(k * rank, (k + 1) * rank) if total != rank else slice(0, rank)
            shape = kernels[path]
            a, b = out.setdefault(
                path,
                [
                    np.zeros((*shape[:-1], rank), np.float32),
                    np.zeros((*shape[:-2], rank, shape[-1]), np.float32),
                ],
            )
            a_at = a[place.layer] if len(shape) == 3 else a
            b_at = b[place.layer] if len(shape) == 3 else b
            rows, cols = place.in_index >= 0, place.out_index >= 0
            a_at[place.in_index[rows]] = lora_A[ranks, rows].T
            b_at[:, place.out_index[cols]] = lora_B[cols, ranks].T * ratio
    return {path: (a, b) for path, (a, b) in out.items()}


def write_peft_adapter(
    adapter: PeftAdapter, directory: str | os.PathLike[str], *, overwrite: bool = False
) -> Path:
    """``adapter_config.json`` and ``adapter_model.safetensors`` in ``directory`` (made);
    ``peft.PeftModel.from_pretrained(base, directory)`` reads them.

    Each file is written beside its name and renamed, the config last: a write that
    fails (a full disk) leaves neither half-written nor a config without its weights,
    and raises ``OSError`` naming the cause (safetensors' ``SafetensorError`` too)."""
    import safetensors.numpy

    directory = Path(directory).absolute()
    files = [directory / ADAPTER_CONFIG, directory / ADAPTER_WEIGHTS]
    if not overwrite and any(f.exists() for f in files):
        raise FileExistsError(
            f"{directory} holds a PEFT adapter: pass overwrite=True to replace it."
        )
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: np.ascontiguousarray(v) for k, v in adapter.tensors.items()}
    partial = [f.with_name(f.name + PARTIAL) for f in files]
    try:
        safetensors.numpy.save_file(tensors, str(partial[1]), metadata={"format": "pt"})
        partial[0].write_text(json.dumps(adapter.config, indent=2, sort_keys=True) + "\n")
        files[0].unlink(missing_ok=True)  # an old config never stands beside new weights
        os.replace(partial[1], files[1])
        os.replace(partial[0], files[0])
    except write_errors() as error:
        for f in partial:
            f.unlink(missing_ok=True)
        if isinstance(error, OSError):
            raise
        raise OSError(f"{directory}: {type(error).__name__}: {error}") from error
    return directory


def read_peft_adapter(directory: str | os.PathLike[str]) -> PeftAdapter:
    """The adapter in a PEFT directory, checked: a LoRA config, an A and a B for every
    module, ``A [r, in]`` and ``B [out, r]`` with the module's rank. ``ValueError``
    naming the problem otherwise."""
    import safetensors.numpy

    directory = Path(directory)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (directory / name).is_file():
            raise ValueError(
                f"{directory}: no {name}; a PEFT adapter directory holds "
                f"{ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}."
            )
    config = json.loads((directory / ADAPTER_CONFIG).read_text())
    if config.get("peft_type") != "LORA":
        raise ValueError(
            f"{directory / ADAPTER_CONFIG}: peft_type is "
            f"{config.get('peft_type')!r}; only 'LORA' adapters are read."
        )
    missing = [k for k in ("r", "lora_alpha") if k not in config]
    if missing:
        raise ValueError(f"{directory / ADAPTER_CONFIG}: no {', '.join(missing)}.")
    tensors = dict(safetensors.numpy.load_file(str(directory / ADAPTER_WEIGHTS)))
    adapter = PeftAdapter(config, tensors)
    for module in adapter.modules():
        if PREFIX + module + _B not in tensors:
            raise ValueError(f"{directory}: {module} has lora_A and no lora_B.")
        a, b = adapter.pair(module)
        r = adapter.rank(module)
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != r or b.shape[1] != r:
            raise ValueError(
                f"{directory}: {module} has lora_A {a.shape} and lora_B {b.shape}; "
                f"PEFT's are [r, in] and [out, r] with r = {r}."
            )
    strays = [k for k in tensors if not k.startswith(PREFIX) or not k.endswith((_A, _B))]
    if strays:
        raise ValueError(f"{directory}: tensors that are not LoRA A/B weights: {strays[:4]}.")
    return adapter
