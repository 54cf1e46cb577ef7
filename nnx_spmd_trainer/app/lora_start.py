"""A run started from a LoRA run (``--config.init_from=<its workdir>``): what becomes of
that run's adapters (``config.lora.init_from_adapters``).

- ``"merge"`` (the default): they are folded into their kernels (``W + alpha / rank *
  A B``, ``callbacks.MergedLoRAWeights``), so the new run starts from the model the LoRA
  run trained, as a plain model. A DPO or GRPO run's reference is then that model itself,
  as DPO's derivation wants (the policy's start); with ``config.lora.rank`` the new run
  trains fresh adapters over it, its reference still costing no copy (the merged base
  with the adapters off).
- ``"keep"``: the same adapters train on, their rank, alpha and targets the LoRA run's
  (read from its ``config.json``); the reference of DPO or GRPO is the base under them,
  the model before the LoRA run (no copy: ``nn.lora.adapters_off``), so the SFT's own
  change is part of what the KL term measures. One set of adapters comes out
  (``--export_format=peft``) over the original base.

Why ``"merge"`` is the default: the reference then is the model that starts the new
run, which is what DPO's implicit reward and GRPO's KL are defined against; ``"keep"``
measures them against an older model, which pulls the run back toward it.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_collections

# callbacks/ is mapped onto nnx_spmd_trainer.callbacks at install time; mypy reads the tree.
from nnx_spmd_trainer import LoRA, callbacks  # type: ignore[attr-defined]
from nnx_spmd_trainer.app import tasks

#: ``config.lora.init_from_adapters``'s values.
MODES = ("merge", "keep")
#: ``config.lora.targets=""``: the attention's q, k and v, by GPT-2's layer names (PEFT's
#: ``c_attn``) and by the shipped GPT's (``mha/query``...).
DEFAULT_LORA_TARGETS = r".*attn/(q|k|v)|.*mha/(query|key|value)"


def mode(config: ml_collections.ConfigDict) -> str:
    """``config.lora.init_from_adapters`` checked (a ``ConfigError`` naming it)."""
    lora = config.get("lora") or {}
    value = str(lora.get("init_from_adapters", "merge") or "merge")
    if value not in MODES:
        raise tasks.ConfigError(
            f"config.lora.init_from_adapters={value!r}: must be 'merge' (fold a LoRA run's "
            "adapters into its base first) or 'keep' (train the same adapters on)."
        )
    return value


def lora_of(section: ml_collections.ConfigDict | dict, key: str = "config.lora") -> LoRA | None:
    """The ``LoRA`` of a config's ``lora`` section (``None`` where its rank is 0); a
    ``ConfigError`` naming ``key`` where ``LoRA`` refuses the values."""
    rank = int(section.get("rank", 0) or 0)
    if not rank:
        return None
    try:
        return LoRA(
            rank=rank,
            alpha=float(section.get("alpha", rank)),
            targets=section.get("targets", "") or DEFAULT_LORA_TARGETS,
            dropout=float(section.get("dropout", 0.0)),
        )
    except ValueError as error:
        raise tasks.ConfigError(f"{key}: {error}") from error


def source_lora(config: ml_collections.ConfigDict) -> LoRA | None:
    """The ``LoRA`` the run ``config.init_from`` names trained with (its workdir's
    ``config.json``); ``None`` where it is no run of this CLI, or trained no adapters."""
    path = config.get("init_from", "") or ""
    if not path:
        return None
    try:  # a weights file or folder has no finished step: not a run of this library
        step = Path(callbacks.CheckpointWeights(path).source)  # type: ignore[arg-type]
    except ValueError:
        return None  # a checkpoint folder without a step is refused with the weights
    # <workdir>/checkpoints/<step>, or a checkpoints folder given alone (no config.json)
    workdir = step.parent.parent if step.parent.name == "checkpoints" else step.parent
    record = workdir / "config.json"
    try:
        section = json.loads(record.read_text(encoding="utf-8")).get("lora") or {}
    except (OSError, ValueError, AttributeError):
        return None
    return lora_of(section, key=f"config.init_from={path!r} ({record}: lora)")


def run_lora(config: ml_collections.ConfigDict) -> LoRA | None:
    """The ``LoRA`` this run trains: ``config.lora``'s; with ``"keep"`` and a LoRA run in
    ``config.init_from``, that run's (a different ``config.lora`` is refused, naming the
    keys)."""
    own = lora_of(config.get("lora") or {})
    if mode(config) != "keep":
        return own
    source = source_lora(config)
    if source is None:
        return own
    if own is not None and (own.rank, own.scale, own.patterns) != (
        source.rank,
        source.scale,
        source.patterns,
    ):
        raise tasks.ConfigError(
            f"config.lora.rank={own.rank} (alpha {own.scale * own.rank:g}, targets "
            f"{own.targets!r}): config.lora.init_from_adapters='keep' trains on the adapters "
            f"of {config.init_from} (rank {source.rank}, alpha {source.scale * source.rank:g}, "
            f"targets {source.targets!r}); leave config.lora.rank/alpha/targets out (they are "
            "that run's), or --config.lora.init_from_adapters=merge to fold them in and train "
            "new ones."
        )
    return source


def checkpoint_weights(config: ml_collections.ConfigDict) -> callbacks.CheckpointWeights:
    """``config.init_from``'s newest finished step as the first state: its adapters folded
    in (``"merge"``) or read with the base (``"keep"``) where it is a LoRA run's; a
    ``ConfigError`` naming the key when there is no finished step."""
    path = config.init_from
    try:
        source = source_lora(config)
        if source is None:
            return callbacks.CheckpointWeights(path)
        if mode(config) == "keep":
            return callbacks.CheckpointWeights(path, whole_model=True)
        return callbacks.MergedLoRAWeights(path, scale=source.scale)
    except tasks.ConfigError:
        raise
    except ValueError as error:
        raise tasks.ConfigError(f"config.init_from={path!r}: {error}") from error
