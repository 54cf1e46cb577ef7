"""``config.init_from`` naming an earlier run of this library: its workdir, its
``checkpoints/`` folder or one step's directory (``callbacks.CheckpointWeights``), told
apart from Hugging Face weights files (``.safetensors``, read through a task's map).

An SFT run then DPO or GRPO on that model::

    nnx-spmd-train --workdir=sft
    nnx-spmd-train --config=dpo --config.init_from=sft --config.data.preferences=pairs.jsonl
"""

from __future__ import annotations

import os
from pathlib import Path

import ml_collections

# callbacks/ is mapped onto nnx_spmd_trainer.callbacks at install time; mypy reads the tree.
from nnx_spmd_trainer import callbacks, weights  # type: ignore[attr-defined]
from nnx_spmd_trainer.app import datasets, tasks

#: The folder of a workdir that holds its steps (``<workdir>/checkpoints``).
CHECKPOINTS = "checkpoints"


def is_checkpoint_directory(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is read as a run's checkpoints: a directory without safetensors
    files (a Hugging Face model folder has them; a workdir, its ``checkpoints/`` and a
    step's directory have none)."""
    path = Path(path)
    if not path.is_dir():
        return False
    return not any(path.glob("*.safetensors")) and not any(path.glob("*.safetensors.index.json"))


def checkpoint_weights(config: ml_collections.ConfigDict) -> callbacks.CheckpointWeights:
    """``config.init_from``'s newest finished step; a ``ConfigError`` naming the key when
    there is none. A LoRA run's adapters are merged first or kept
    (``config.lora.init_from_adapters``: ``lora_start``)."""
    from nnx_spmd_trainer.app import lora_start

    return lora_start.checkpoint_weights(config)


def run_that_wrote(step: Path) -> Path:
    """The workdir of a step directory the CLI wrote (``<workdir>/checkpoints/<step>``)."""
    parent = step.parent
    return parent.parent if parent.name == CHECKPOINTS else parent


def pretrained(config: ml_collections.ConfigDict, task: tasks.Task) -> weights.Pretrained | None:
    """Where the first state comes from: ``config.init_from`` read through the task's weight
    map, or an earlier run's checkpoints (its workdir, ``checkpoints/`` or a step's
    directory: ``callbacks.CheckpointWeights``), or ``None`` (random) where the key is
    ``""`` or absent. A weights file for a task without a map, a path with nothing there,
    or a directory without a finished step is a ``ConfigError`` naming the key."""
    path = config.get("init_from", "") or ""
    if not path:
        return None
    if is_checkpoint_directory(path):
        # check_init_from says it is read, where it is: a resume never reads it
        return checkpoint_weights(config)
    key = f"config.init_from={path!r}"
    if not Path(path).exists():
        raise tasks.ConfigError(f"{key}: there is no file or directory there.")
    # A task without a map reads a file under the model's own parameter paths (what
    # --export_format=merged or safetensors writes for it): weight_map=None.
    return weights.Pretrained(path, task.weight_map)


def tokenizer_config(
    config: ml_collections.ConfigDict, workdir: str | os.PathLike[str]
) -> ml_collections.ConfigDict:
    """``datasets.from_config.run_tokenizer_config``: the run's own saved tokenizer when it
    resumes; else, starting from an earlier run's checkpoint, that run's
    ``tokenizer.json`` (its model's ids are that tokenizer's), or the one beside an
    export's weights (``--export_format=merged`` copies it there), on the same terms (a
    BPE the job would train, of the same ``vocab_size``)."""
    own = datasets.from_config.run_tokenizer_config(config, workdir)
    path = config.get("init_from", "") or ""
    if own is not config or not path:
        return own
    if not is_checkpoint_directory(path):  # a weights folder, or a file in one
        folder = Path(path) if Path(path).is_dir() else Path(path).parent
        return datasets.from_config.run_tokenizer_config(config, folder)
    try:
        step = Path(callbacks.CheckpointWeights(path).source)  # type: ignore[arg-type]
    except ValueError:
        return own  # refused with the weights, naming the key
    return datasets.from_config.run_tokenizer_config(config, run_that_wrote(step))
