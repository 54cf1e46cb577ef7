"""LoRA fine-tuning of a built model: only the low-rank adapters train (``lora=LoRA(...)``).

    python examples/lora.py          # tiny: 30 + 30 steps on 8 simulated CPU devices
    python examples/lora.py --full   # wider model, more steps

A base MLP is first trained on one task (standing in for a pretrained model
you load). The built module is then handed to a new ``Trainer`` with
``lora=LoRA(rank=4, targets=["fc1", "fc2"])``: adapters are added beside both
layers (``fc1/lora_a``, ``fc1/lora_b``, the base kernel staying at ``fc1/kernel``),
laid out as their base layers are, and only they train: gradients and optimizer
state exist for the adapters alone, and the base weights stay bit-identical,
weight decay included. The script checks both: the fine-tuning loss fell, and
every base weight equals its value before. ``examples/finetune.py`` walks the
whole path from a weights file to PEFT and merged exports.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from nnx_spmd_trainer import FSDP, LoRA, Trainer  # noqa: E402
from nnx_spmd_trainer.app.datasets.synthetic import make_classification  # noqa: E402
from nnx_spmd_trainer.app.models import MLP  # noqa: E402
from nnx_spmd_trainer.app.models.mlp import loss_fn  # noqa: E402
from nnx_spmd_trainer.callbacks import MetricsLogger  # noqa: E402
from nnx_spmd_trainer.data.grain_input import grain_pipeline  # noqa: E402

FEATURES, CLASSES = 16, 4


def task(seed: int, batch: int):
    """An endless Grain input pipeline of a teacher network's labels; each seed its own teacher."""
    x, y = make_classification(4096, FEATURES, CLASSES, seed=seed)
    return grain_pipeline(
        len(x), batch, seed=0, batch_fn=lambda i: {"inputs": x[i], "labels": y[i]}
    )


def weights(module: nnx.Module, kind: nnx.filterlib.Filter) -> dict[str, np.ndarray]:
    """``{path: host copy}`` of the variables ``kind`` names."""
    return {
        "/".join(map(str, path)): np.asarray(jax.device_get(v.get_value()))
        for path, v in nnx.to_flat_state(nnx.state(module, kind))
    }


def main(full: bool = False) -> float:
    hidden, steps, batch, rank = (512, 300, 128, 8) if full else (64, 30, 64, 4)

    # 1. "Pretraining": every parameter trains on the first task.
    pretrain = Trainer(
        lambda rngs: MLP(FEATURES, hidden, CLASSES, rngs=rngs),
        optax.adam(1e-2),
        strategy=FSDP(min_size=1),
        loss_fn=loss_fn,
    )
    pretrain.fit(task(seed=0, batch=batch), max_steps=steps)
    model = pretrain.model  # a built nnx.Module, as a checkpoint or a model hub would give
    frozen = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))  # LoRAParam subclasses Param
    base = weights(model, frozen)

    # 2. Fine-tune on a second task with adapters beside both layers:
    # y = base(x) + alpha/rank * (x A) B, A and B nnx.LoRAParams; only they train.
    finetune = Trainer(
        model,  # already built: its state is placed on the mesh by the strategy
        optax.adamw(1e-2, weight_decay=0.1),
        strategy=FSDP(min_size=1),
        loss_fn=loss_fn,
        lora=LoRA(rank=rank, targets=["fc1", "fc2"]),
        log_every_n_steps=10,
        callbacks=[MetricsLogger(10)],
    )
    losses = finetune.fit(task(seed=1, batch=batch), max_steps=steps).history["train/loss"]
    after = weights(finetune.model, frozen)
    adapters = weights(finetune.model, nnx.LoRAParam)
    print(f"fine-tuning loss {losses[0]:.3f} -> {losses[-1]:.3f}; trained "
          f"{sum(a.size for a in adapters.values())} adapter weights, froze "
          f"{sum(b.size for b in base.values())} base weights")  # fmt: skip

    changed = [path for path in base if not np.array_equal(after[path], base[path])]
    if changed:
        raise SystemExit(f"FAILED: base weights changed: {changed}")
    if not losses[-1] < losses[0]:
        raise SystemExit(f"FAILED: the fine-tuning loss did not fall ({losses})")
    print("OK: lora: the fine-tuning loss fell and the base weights are bit-identical")
    return losses[-1]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="real sizes instead of tiny ones")
    main(parser.parse_args().full)
