"""``--export``: the trained parameters (or their average) written after a run, in a
plain Orbax checkpoint or the task's pretrained file format."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import jax
import ml_collections
from flax import nnx

from nnx_spmd_trainer import Trainer, export_params, weights
from nnx_spmd_trainer.app import lora_start, tasks
from nnx_spmd_trainer.app.models import gpt2_hf

#: ``--export_format``'s choices: a plain Orbax checkpoint of the model's tree, the
#: task's pretrained file format (its weight map's names: Hugging Face's for gpt2_hf),
#: and for a LoRA run (``config.lora.rank``) the adapters alone as a PEFT adapter
#: directory, or the adapters merged into the base in the pretrained file format.
EXPORT_FORMATS = ("orbax", "safetensors", "peft", "merged")
#: The formats that need LoRA adapters to write.
LORA_FORMATS = ("peft", "merged")
#: The file ``export(..., "safetensors")`` writes in the ``--export`` directory (HF's name).
SAFETENSORS_FILE = "model.safetensors"


#: ``config.lora.targets=""`` (``lora_start``'s): the attention's q, k and v.
DEFAULT_LORA_TARGETS = lora_start.DEFAULT_LORA_TARGETS


def lora_settings(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """``Trainer``'s ``lora=`` (``{}``: none): ``config.lora``'s ``LoRA``, or, starting
    from a LoRA run with ``config.lora.init_from_adapters='keep'``, that run's
    (``lora_start.run_lora``); a ``ConfigError`` naming the key where ``LoRA`` refuses
    the values, so a LoRA run never trains the whole model instead. The plan holds it
    from then on: what exports read (``nn_lora_of``)."""
    found = lora_start.run_lora(config)
    return {"lora": found} if found is not None else {}


def check_export_format(
    config: ml_collections.ConfigDict, task: tasks.Task, export_format: str
) -> None:
    """A ``ConfigError`` naming ``--export_format`` where it is unknown, asks for LoRA
    adapters of a run without them, or is ``"peft"`` for a task without a weight map
    (PEFT's module names are Hugging Face's). ``"safetensors"`` and ``"merged"`` need no
    map: a model without one is written under its own parameter paths."""
    key = f"--export_format={export_format}"
    if export_format not in EXPORT_FORMATS:
        raise tasks.ConfigError(f"{key}: must be one of {', '.join(EXPORT_FORMATS)}.")
    if export_format in LORA_FORMATS and not lora_settings(config):
        raise tasks.ConfigError(
            f"{key}: this run trains no LoRA adapters (config.lora.rank=0); give "
            "--config.lora.rank=8 (say), or --export_format=safetensors for the whole model."
        )
    if export_format == "safetensors" and lora_settings(config):
        raise tasks.ConfigError(
            f"{key}: this run trains LoRA adapters, which a safetensors file of the model "
            "has no place for; use --export_format=merged (folded into the base) or peft."
        )
    if export_format == "peft" and task.weight_map is None:
        raise tasks.ConfigError(
            f"{key}: config.model={config.model!r} has no weight map to name a PEFT adapter's "
            "modules through (PEFT's names are Hugging Face's; config.model='gpt2_hf' has "
            "them); use --export_format=merged (the adapters folded into the base, under "
            "the model's own names) or orbax."
        )


def export(
    trainer: Trainer,
    directory: str | os.PathLike[str],
    export_format: str,
    *,
    weight_map: weights.WeightMap | None = None,
    ema: bool = False,
    lora: Any = None,
    workdir: str | os.PathLike[str] | None = None,
) -> Path:
    """``trainer``'s parameters written under ``directory`` (``--export``), which is
    written whole or not at all (``data.written.written_whole``: a full disk leaves it as
    it was, and the same export succeeds once there is room; a failed write is an
    ``OSError`` naming the cause).

    - ``"orbax"``: a plain Orbax checkpoint there (``export_params``);
    - ``"safetensors"``: ``directory/model.safetensors`` through the task's ``weight_map``
      (Hugging Face's names and shapes for gpt2_hf, with its ``config.json``:
      ``transformers`` loads the directory), or, without one, under the model's own
      parameter paths (``--config.init_from=directory`` reads it);
    - ``"peft"``: the LoRA adapters alone as a PEFT adapter directory (``weights.peft``),
      naming the base where the run knows it (``config.init_from``'s weights folder);
    - ``"merged"``: the adapters folded into the base (``W + alpha / rank * A B``, each
      layer at its own scale), written as ``"safetensors"`` writes the base.

    The LoRA settings are the plan's (``trainer.plan.lora``): ``lora`` is ignored, kept
    for callers of the old signature. ``ema`` (``--export_ema``): the average of the
    weights (``config.ema_decay``) in their place. ``workdir``: the run's, whose
    ``tokenizer.json`` goes beside a merged or safetensors export. Every process calls it.
    """
    del lora  # one owner: the plan's LoRA
    if export_format not in EXPORT_FORMATS:
        raise tasks.ConfigError(f"--export_format={export_format}: must be one of {EXPORT_FORMATS}")
    if export_format in LORA_FORMATS and not nn_lora_of(trainer):
        raise tasks.ConfigError(f"--export_format={export_format}: the run has no LoRA.")
    if export_format == "peft" and weight_map is None:
        raise tasks.ConfigError("--export_format=peft: the task has no weight map.")
    if export_format == "safetensors" and nn_lora_of(trainer):
        raise tasks.ConfigError(
            "--export_format=safetensors: the model holds LoRA adapters; use merged or peft."
        )
    with trainer.ema_weights() if ema else contextlib.nullcontext():
        if export_format == "orbax":
            return export_params(trainer.model, directory)
        with weights.written_whole(directory) as partial:
            if export_format == "peft":
                assert weight_map is not None
                write_peft(trainer, partial, weight_map)
            else:
                params: Any = (
                    weights.merged_params(trainer.model)  # each layer at its own scale
                    if export_format == "merged"
                    else nnx.state(trainer.model, nnx.Param)
                )
                names = weight_map or weights.WeightMap.identity(params)
                weights.save_safetensors(params, partial / SAFETENSORS_FILE, names)
                write_model_config(trainer.model, partial)
                copy_tokenizer(workdir, partial)
    path = Path(directory).absolute()
    return path if export_format == "peft" else path / SAFETENSORS_FILE


def nn_lora_of(trainer: Trainer) -> dict[str, Any]:
    """The run's LoRA settings, one owner: the plan's ``LoRA`` (``rank``, ``alpha``,
    ``dropout``); for a model adapted by Flax's own ``nnx.LoRA`` (no plan LoRA), the
    adapters' rank at a scale of 1 (that wrapper's). ``{}``: no adapters."""
    plan_lora = getattr(trainer.plan, "lora", None)
    if plan_lora is not None:
        alpha = plan_lora.scale * plan_lora.rank
        return {"rank": plan_lora.rank, "alpha": alpha, "dropout": plan_lora.dropout}
    pairs = weights.lora_pairs(trainer.model)
    if not pairs:
        return {}
    rank = int(next(iter(pairs.values()))[0].shape[-1])
    return {"rank": rank, "alpha": float(rank), "dropout": 0.0}


def write_peft(trainer: Trainer, directory: Path, weight_map: weights.WeightMap) -> None:
    """``--export_format=peft``: ``adapter_config.json`` and ``adapter_model.safetensors``
    in ``directory``, the base named where ``config.init_from`` is a weights folder."""
    settings = nn_lora_of(trainer)
    # fan_in_fan_out and the module names come from the task's map (gpt2_hf: HF's Conv1D
    # is [in, out], its modules under GPT2LMHeadModel's "transformer.").
    adapter = weights.peft_adapter(
        weights.lora_pairs(trainer.model), weight_map, rank=settings["rank"],
        alpha=float(settings["alpha"]), dropout=float(settings["dropout"]),
        base_model_name_or_path=base_model_of(trainer.config),
    )  # fmt: skip
    if jax.process_index() == 0:
        weights.write_peft_adapter(adapter, directory, overwrite=True)


def base_model_of(config: Any) -> str | None:
    """The base a PEFT adapter names (``base_model_name_or_path``): ``config.init_from``'s
    weights folder (the directory of a ``.safetensors`` file), absolute; ``None`` where the
    run started from random weights or from a checkpoint of this library (no folder
    ``transformers`` reads)."""
    path = config.get("init_from", "") if isinstance(config, ml_collections.ConfigDict) else ""
    if not path:
        return None
    path = Path(path).absolute()
    folder = path.parent if path.is_file() else path
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.safetensors.index.json")):
        return None
    return str(folder)


def write_model_config(model: Any, directory: Path) -> None:
    """``config.json`` (Hugging Face's ``GPT2Config``) beside a GPT-2's safetensors file, so
    ``transformers.AutoModelForCausalLM.from_pretrained(directory)`` reads the folder;
    nothing for a model that has no Hugging Face counterpart."""
    config = getattr(model, "config", None)
    if not isinstance(config, gpt2_hf.GPT2Config) or jax.process_index() != 0:
        return
    hf = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.n_positions,
        "n_ctx": config.n_positions,
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": None,  # 4 * n_embd, as the model's MLP
        "activation_function": "gelu_new",  # the tanh-approximate GELU, as the model's
        "layer_norm_epsilon": config.layer_norm_epsilon,
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout,
        "initializer_range": 0.02,
        "tie_word_embeddings": True,  # the head is the token embedding, as the model's
        "bos_token_id": min(50256, config.vocab_size - 1),
        "eos_token_id": min(50256, config.vocab_size - 1),
        "torch_dtype": "float32",
    }
    (directory / "config.json").write_text(json.dumps(hf, indent=2) + "\n")


def copy_tokenizer(workdir: str | os.PathLike[str] | None, directory: Path) -> None:
    """The run's ``tokenizer.json`` (where it saved one) beside the export: what decodes
    the model's ids, for ``transformers.AutoTokenizer`` and ``--config.init_from``."""
    if workdir is None or jax.process_index() != 0:
        return
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        source = Path(workdir) / name
        if source.is_file():
            shutil.copyfile(source, directory / name)
