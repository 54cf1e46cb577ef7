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
from nnx_spmd_trainer import callbacks  # type: ignore[attr-defined]
from nnx_spmd_trainer.app import datasets, tasks


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
    there is none."""
    path = config.init_from
    try:
        return callbacks.CheckpointWeights(path)
    except ValueError as error:
        raise tasks.ConfigError(f"config.init_from={path!r}: {error}") from error


def run_that_wrote(step: Path) -> Path:
    """The workdir of a step directory the CLI wrote (``<workdir>/checkpoints/<step>``)."""
    parent = step.parent
    return parent.parent if parent.name == callbacks.checkpoint.start_from.CHECKPOINTS else parent


def tokenizer_config(
    config: ml_collections.ConfigDict, workdir: str | os.PathLike[str]
) -> ml_collections.ConfigDict:
    """``datasets.from_config.run_tokenizer_config``: the run's own saved tokenizer when it
    resumes; else, starting from an earlier run's checkpoint, that run's
    ``tokenizer.json`` (its model's ids are that tokenizer's), on the same terms (a BPE the
    job would train, of the same ``vocab_size``)."""
    own = datasets.from_config.run_tokenizer_config(config, workdir)
    path = config.get("init_from", "") or ""
    if own is not config or not path or not is_checkpoint_directory(path):
        return own
    try:
        step = callbacks.checkpoint.start_from.newest_step(path)
    except ValueError:
        return own  # refused with the weights, naming the key
    return datasets.from_config.run_tokenizer_config(config, run_that_wrote(step))
