"""LoRA fine-tuning of Hugging Face's GPT-2 from its safetensors file, under FSDP x TP.

    python examples/lora_gpt2.py                     # tiny: a 1-layer GPT-2, 30 steps
    python examples/lora_gpt2.py --full              # GPT-2 small's sizes (124M), 200 steps
    python examples/lora_gpt2.py --full --weights model.safetensors   # the real GPT-2

No download: the script first writes a random GPT-2 under Hugging Face's names
and shapes (``wte.weight``, ``h.0.attn.c_attn.weight`` as Conv1D's ``(in, out)``,
...), standing in for the hub's ``model.safetensors`` (``--weights`` reads a real
one instead). The model is ``app.models.gpt2_hf.GPT2`` with its attention's
projections wrapped in ``nnx.LoRA`` adapters (rank 4; ``base_module`` holds the
pretrained layer), laid out ``Hybrid(FSDP(4), TensorParallel(2))``. The
``Trainer`` builds its first state from the file
(``init_from=weights.Pretrained(...)``): each device reads only its own blocks
of each tensor, and ``fresh=nnx.LoRAParam`` leaves the adapters, which the file
does not have, to their initializer. ``wrt=nnx.LoRAParam`` trains the adapters
alone on the pydoc text as GPT-2's single-byte tokens. The script checks its
result: the loss fell, and the base weights, exported back to safetensors
through the same map (``weights.save_safetensors``), equal the file bit for bit.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import tempfile
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import safetensors.numpy  # noqa: E402
from flax import nnx  # noqa: E402

from nnx_spmd_trainer import FSDP, Hybrid, TensorParallel, Trainer, weights  # noqa: E402
from nnx_spmd_trainer.app.datasets.text import byte_lm_splits  # noqa: E402
from nnx_spmd_trainer.app.models.gpt2_hf import (  # noqa: E402
    GPT2,
    GPT2Config,
    gpt2_weight_map,
    loss_fn,
)
from nnx_spmd_trainer.callbacks import MetricsLogger  # noqa: E402

ADAPTED = ("q", "k", "v", "c_proj")  # the attention's projections get adapters


def write_random_gpt2(config: GPT2Config, path: Path, seed: int = 0) -> Path:
    """A GPT-2 safetensors file as HF's ``GPT2LMHeadModel`` saves it (every name under
    ``transformer.``), with GPT-2's initialisation: normal(0.02) weights, LayerNorms at 1
    and 0. The names and shapes are those the map reads (``WeightMap.sources``)."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, declared in gpt2_weight_map(config).sources().items():
        if name.endswith(".bias"):
            value = np.zeros(declared.shape, declared.dtype)
        elif re.search(r"ln_(1|2|f)\.weight$", name):
            value = np.ones(declared.shape, declared.dtype)
        else:
            value = rng.normal(0.0, 0.02, declared.shape).astype(declared.dtype)
        tensors[f"transformer.{name}"] = value
    safetensors.numpy.save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def lora_gpt2(config: GPT2Config, rank: int, rngs: nnx.Rngs) -> GPT2:
    """GPT-2 with each attention projection in ``ADAPTED`` wrapped in ``nnx.LoRA``:
    ``y = base(x) + x @ lora_a @ lora_b`` (``lora_b`` starts at zero, so the wrapped
    model starts as the pretrained one)."""
    model = GPT2(config, rngs)
    for block in model.h:
        for name in ADAPTED:
            base = getattr(block.attn, name)
            lora = nnx.LoRA(base.in_features, rank, base.out_features, base_module=base, rngs=rngs)
            setattr(block.attn, name, lora)
    return model


def lora_weight_map(config: GPT2Config) -> weights.WeightMap:
    """``gpt2_weight_map`` with each adapted layer's arrays under its ``base_module``:
    ``h/0/attn/q/kernel`` is ``h/0/attn/q/base_module/kernel`` in the wrapped model."""
    plain = gpt2_weight_map(config)
    moved = re.compile(rf"(h/\d+/attn/(?:{'|'.join(ADAPTED)}))/(kernel|bias)")
    targets = {moved.sub(r"\1/base_module/\2", path): e for path, e in plain.targets.items()}
    return dataclasses.replace(plain, targets=targets)


def main(full: bool = False, weights_path: str | None = None) -> float:
    if full:  # GPT-2 small; its 50257 tokens padded to 50304 so that TP(2) divides them
        config = GPT2Config(dropout=0.0, pad_vocab_to=64)
        steps, batch, seq_len, rank, every = 200, 16, 128, 8, 20
    else:  # the 256 byte tokens the text uses
        config = GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=1, n_head=4,
                            dropout=0.0, pad_vocab_to=8)  # fmt: skip
        steps, batch, seq_len, rank, every = 30, 16, 32, 4, 10

    with tempfile.TemporaryDirectory() as tmp:
        if weights_path is None:  # stands in for the hub's model.safetensors
            path = write_random_gpt2(config, Path(tmp) / "model.safetensors")
        else:
            path = Path(weights_path)
        weight_map = lora_weight_map(config)
        _, splits = byte_lm_splits(seq_len=seq_len, batch_size=batch, seed=0)

        trainer = Trainer(
            lambda rngs: lora_gpt2(config, rank, rngs),
            optax.adamw(3e-2, weight_decay=0.01),
            strategy=Hybrid(FSDP(4), TensorParallel(2)),
            loss_fn=loss_fn,
            wrt=nnx.LoRAParam,  # gradients and optimizer state for the adapters alone
            init_from=weights.Pretrained(path, weight_map, fresh=nnx.LoRAParam),
            log_every_n_steps=every,
            track_norms=False,  # no gradient norms at log points: one compiled step, not two
            callbacks=[MetricsLogger(every)],
        )
        losses = trainer.fit(splits.train, max_steps=steps).history["train/loss"]

        # The base weights, exported through the same map, are the file bit for bit.
        frozen = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))
        exported = weights.save_safetensors(
            nnx.state(trainer.model, frozen), Path(tmp) / "base.safetensors", weight_map
        )
        original, after = (safetensors.numpy.load_file(str(p)) for p in (path, exported))
        original = {k.removeprefix("transformer."): v for k, v in original.items()}
        changed = [k for k, v in after.items() if not np.array_equal(v, original[k])]
        adapters = nnx.state(trainer.model, nnx.LoRAParam)
        trained = sum(x.size for x in jax.tree.leaves(adapters))
        frozen_count = sum(v.size for v in after.values())

    print(f"fine-tuning loss {losses[0]:.3f} -> {losses[-1]:.3f}; trained {trained} adapter "
          f"weights, froze {frozen_count} pretrained weights")  # fmt: skip
    if changed or set(after) != set(original) - {"lm_head.weight"}:
        raise SystemExit(f"FAILED: the base weights changed or were not all read: {changed}")
    if not losses[-1] < losses[0]:
        raise SystemExit(f"FAILED: the fine-tuning loss did not fall ({losses})")
    print("OK: lora_gpt2: the loss fell and the base weights equal the file bit for bit")
    return losses[-1]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="GPT-2 small's sizes, more steps")
    parser.add_argument("--weights", help="a GPT-2 small model.safetensors to start from")
    args = parser.parse_args()
    if args.weights and not args.full:
        parser.error("--weights is a GPT-2 small file: pass --full with it")
    main(args.full, args.weights)
