"""``--export``: the trained parameters (or their average) written after a run, in a
plain Orbax checkpoint or the task's pretrained file format."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import jax
import ml_collections

from nnx_spmd_trainer import LoRA, Trainer, export_params, weights
from nnx_spmd_trainer.app import tasks

#: ``--export_format``'s choices: a plain Orbax checkpoint of the model's tree, the
#: task's pretrained file format (its weight map's names: Hugging Face's for gpt2_hf),
#: and for a LoRA run (``config.lora.rank``) the adapters alone as a PEFT adapter
#: directory, or the adapters merged into the base in the pretrained file format.
EXPORT_FORMATS = ("orbax", "safetensors", "peft", "merged")
#: The formats that need LoRA adapters to write.
LORA_FORMATS = ("peft", "merged")
#: The file ``export(..., "safetensors")`` writes in the ``--export`` directory (HF's name).
SAFETENSORS_FILE = "model.safetensors"


def lora_rank(config: ml_collections.ConfigDict) -> int:
    """``config.lora.rank`` (0 where the config has no ``lora`` section: LoRA is off)."""
    lora = config.get("lora")
    return int(lora.get("rank", 0) or 0) if lora is not None else 0


#: ``config.lora.targets=""``: the attention's q, k and v, by GPT-2's layer names (PEFT's
#: ``c_attn``) and by the shipped GPT's (``mha/query``...).
DEFAULT_LORA_TARGETS = r".*attn/(q|k|v)|.*mha/(query|key|value)"


def lora_settings(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """``Trainer``'s ``lora=`` from ``config.lora`` (``{}`` where the rank is 0); a
    ``ConfigError`` naming the key where this library has no ``LoRA`` or it refuses the
    values, so a LoRA run never trains the whole model instead."""
    rank = lora_rank(config)
    if not rank:
        return {}
    lora = config.lora
    try:
        return {
            "lora": LoRA(
                rank=rank,
                alpha=float(lora.get("alpha", rank)),
                targets=lora.get("targets", "") or DEFAULT_LORA_TARGETS,
                dropout=float(lora.get("dropout", 0.0)),
            )
        }
    except ValueError as error:
        raise tasks.ConfigError(f"config.lora: {error}") from error


def check_export_format(
    config: ml_collections.ConfigDict, task: tasks.Task, export_format: str
) -> None:
    """A ``ConfigError`` naming ``--export_format`` where it is unknown, or where it is
    ``"safetensors"`` and the task has no weight map to write the names through."""
    key = f"--export_format={export_format}"
    if export_format not in EXPORT_FORMATS:
        raise tasks.ConfigError(f"{key}: must be one of {', '.join(EXPORT_FORMATS)}.")
    if export_format in LORA_FORMATS and not lora_rank(config):
        raise tasks.ConfigError(
            f"{key}: this run trains no LoRA adapters (config.lora.rank=0); give "
            "--config.lora.rank=8 (say), or --export_format=safetensors for the whole model."
        )
    if export_format in ("safetensors", *LORA_FORMATS) and task.weight_map is None:
        raise tasks.ConfigError(
            f"{key}: config.model={config.model!r} has no weight map to write a safetensors "
            "file's names through (config.model='gpt2_hf' has one: Hugging Face's GPT-2); "
            "use --export_format=orbax."
        )


def export(
    trainer: Trainer,
    directory: str | os.PathLike[str],
    export_format: str,
    *,
    weight_map: weights.WeightMap | None = None,
    ema: bool = False,
    lora: ml_collections.ConfigDict | None = None,
) -> Path:
    """``trainer``'s parameters written under ``directory`` (``--export``): a plain Orbax
    checkpoint there (``export_params``), or, with ``"safetensors"``, the file
    ``directory/model.safetensors`` through the task's ``weight_map`` (Hugging Face's
    names and shapes for gpt2_hf: ``transformers`` loads the directory). ``ema``
    (``--export_ema``): the average of the weights (``config.ema_decay``) in their place.
    ``"peft"``: the LoRA adapters alone as a PEFT adapter directory (``weights.peft``);
    ``"merged"``: the adapters folded into the base (``W + alpha / rank * A B``), as
    ``"safetensors"`` writes the base; ``lora`` (``config.lora``) gives rank and alpha.
    Every process calls it.
    """
    if export_format in LORA_FORMATS:
        if weight_map is None or lora is None or not lora.get("rank"):
            raise tasks.ConfigError(f"--export_format={export_format}: the run has no LoRA.")
        with trainer.ema_weights() if ema else contextlib.nullcontext():
            return export_lora(trainer, Path(directory), export_format, weight_map, lora)
    with trainer.ema_weights() if ema else contextlib.nullcontext():
        if export_format != "safetensors":
            return export_params(trainer.model, directory)
        if weight_map is None:
            raise tasks.ConfigError(f"--export_format={export_format}: the task has no weight map.")
        Path(directory).mkdir(parents=True, exist_ok=True)
        return trainer.export(Path(directory) / SAFETENSORS_FILE, weight_map=weight_map)


def export_lora(
    trainer: Trainer,
    directory: Path,
    export_format: str,
    weight_map: weights.WeightMap,
    lora: ml_collections.ConfigDict,
) -> Path:
    """``--export_format=peft`` (``directory`` holds ``adapter_config.json`` and
    ``adapter_model.safetensors``) or ``merged`` (``directory/model.safetensors``)."""
    rank, alpha = int(lora.rank), float(lora.alpha)
    if export_format == "merged":
        directory.mkdir(parents=True, exist_ok=True)
        params = weights.merged_params(trainer.model, scale=alpha / rank)
        return weights.save_safetensors(params, directory / SAFETENSORS_FILE, weight_map)
    # fan_in_fan_out and the module names come from the task's map (gpt2_hf: HF's Conv1D
    # is [in, out], its modules under GPT2LMHeadModel's "transformer.").
    adapter = weights.peft_adapter(
        weights.lora_pairs(trainer.model), weight_map, rank=rank, alpha=alpha,
        dropout=float(lora.get("dropout", 0.0)),
    )  # fmt: skip
    if jax.process_index() == 0:
        weights.write_peft_adapter(adapter, directory)
    return directory
