"""Fine-tune what you load: a GPT-2 file, LoRA adapters, chat rows, then PEFT and merged out.

    python examples/finetune.py          # tiny: a 2-layer GPT-2, 40 steps on 8 CPU devices
    python examples/finetune.py --full   # wider and deeper, more steps

Needs transformers for the chat template (no torch): ``pip install 'nnx-spmd-trainer[chat]'``.

The path a researcher takes, end to end, with nothing downloaded:

1. **The pretrained model**: a GPT-2 safetensors file under Hugging Face's names and
   shapes, read through the task's weight map (``init_from=weights.Pretrained``). The
   script writes a random one that stands in for the hub's ``model.safetensors``.
2. **Chat data**: conversations (``{"messages": [...]}`` rows of a JSONL file),
   rendered with the ChatML template by a byte-level BPE trained here, packed into rows
   whose loss falls on the assistant's tokens alone (``loss_weights``).
3. **LoRA**: ``Trainer(..., lora=LoRA(rank, alpha, targets))`` adds adapters beside the
   attention's q and v after the base is loaded, lays them out from their base layers
   under ``Hybrid(FSDP(4), TensorParallel(2))`` and trains them alone.
4. **Out**: the adapters as a PEFT adapter directory (``adapter_config.json`` +
   ``adapter_model.safetensors``, ``PeftModel.from_pretrained(base, DIR)`` reads it),
   and the adapters merged into the base (``W + alpha / rank * A B``) as a plain
   GPT-2 ``model.safetensors`` that ``transformers`` (or ``init_from``) loads.

The script checks its result: the loss fell, the base is bitwise the file, the PEFT
directory reads back to the trained adapters, and the merged file, loaded as a plain
GPT-2, gives the adapted model's logits.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np  # noqa: E402
import optax  # noqa: E402
import safetensors.numpy  # noqa: E402
from flax import nnx  # noqa: E402

from nnx_spmd_trainer import (  # noqa: E402
    FSDP,
    Hybrid,
    LoRA,
    TensorParallel,
    Trainer,
    data,
    lora,
    weights,
)
from nnx_spmd_trainer.app.models.gpt2_hf import (  # noqa: E402
    GPT2,
    GPT2Config,
    gpt2_weight_map,
    loss_fn,
)
from nnx_spmd_trainer.callbacks import MetricsLogger  # noqa: E402
from nnx_spmd_trainer.data.tokenizer import EOS_TOKEN  # noqa: E402


def write_conversations(path: Path, operation: str, count: int, seed: int = 0) -> Path:
    """A JSONL file of small conversations: a system line, a question, its answer."""
    rng = np.random.default_rng(seed)
    with path.open("w") as f:
        for _ in range(count):
            a, b = (int(x) for x in rng.integers(0, 50, size=2))
            answer = a + b if operation == "plus" else a - b
            messages = [
                {"role": "system", "content": "Answer with the number."},
                {"role": "user", "content": f"What is {a} {operation} {b}?"},
                {"role": "assistant", "content": f"{answer}."},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def chat_rows(path: Path, tokenizer: data.ChatTokenizer, seq_len: int, batch: int):
    """Packed rows of the conversations in ``path``, the loss on the assistant's tokens."""
    documents, counts = data.chat_documents(data.read_conversations(path), tokenizer, seq_len)
    print(counts.line(path.name, seq_len))
    return data.packed_pipeline(documents, seq_len, batch, weighted=True)


def logits_of(model: nnx.Module, tokens: np.ndarray) -> np.ndarray:
    model.eval()
    return np.asarray(nnx.jit(lambda m, t: m(t))(model, tokens))


def main(full: bool = False, out: str | None = None) -> float:
    sizes = dict(n_embd=128, n_layer=4, n_head=4) if full else dict(n_embd=64, n_layer=2, n_head=4)
    steps, rank, alpha, seq_len, batch = (300, 8, 16.0, 128, 32) if full else (40, 4, 8.0, 64, 16)
    work = Path(out) if out else Path(tempfile.mkdtemp(prefix="finetune-"))
    (work / "merged").mkdir(parents=True, exist_ok=True)
    strategy = Hybrid(FSDP(4), TensorParallel(2))

    # A byte-level BPE with ChatML's turn markers (never split), and its template.
    minus = write_conversations(work / "minus.jsonl", "minus", count=400, seed=0)
    plus = write_conversations(work / "plus.jsonl", "plus", count=400, seed=1)
    texts = [m["content"] for p in (minus, plus) for _, c in data.read_conversations(p) for m in c]
    bpe = data.train_bpe(texts=[*texts, "system user assistant"], vocab_size=400,
                         special_tokens=(EOS_TOKEN, *data.CHATML_TOKENS))  # fmt: skip
    tokenizer = data.ChatTokenizer.from_tokenizer(bpe)  # data.CHATML_TEMPLATE
    config = GPT2Config(vocab_size=tokenizer.vocab_size, n_positions=seq_len, dropout=0.0,
                        pad_vocab_to=8, **sizes)  # fmt: skip
    weight_map = gpt2_weight_map(config)  # Hugging Face's GPT-2 names and shapes

    # 1. The pretrained model: here a GPT-2 trained whole on subtraction, written as
    # Hugging Face writes GPT-2 (the hub's model.safetensors would do as well).
    pretrain = Trainer(lambda rngs: GPT2(config, rngs), optax.adamw(3e-3), strategy=strategy,
                       loss_fn=loss_fn, track_norms=False)  # fmt: skip
    pretrain.fit(chat_rows(minus, tokenizer, seq_len, batch), max_steps=2 * steps)
    base_file = pretrain.export(work / "model.safetensors", weight_map=weight_map)

    # 2. LoRA on addition: adapters on q and v, added after init_from loads the base, laid
    # out from their base layers; only they train (gradients, optimizer state).
    trainer = Trainer(
        lambda rngs: GPT2(config, rngs),
        optax.adamw(1e-2, weight_decay=0.0),
        strategy=strategy,
        loss_fn=loss_fn,  # the mean over the batch's assistant tokens (loss_weights)
        lora=LoRA(rank=rank, alpha=alpha, targets=r".*attn/(q|v)"),
        init_from=weights.Pretrained(base_file, weight_map),
        log_every_n_steps=10,
        track_norms=False,
        callbacks=[MetricsLogger(10)],
    )
    rows = chat_rows(plus, tokenizer, seq_len, batch)
    losses = trainer.fit(rows, max_steps=steps).history["train/loss"]
    model = trainer.model

    # 3a. The adapters alone, as PEFT writes them for GPT2LMHeadModel: the map says its
    # Conv1D files are [in, out] (fan_in_fan_out) and its modules are under "transformer.".
    pairs = weights.lora_pairs(model)  # {base kernel path: (lora_a, lora_b)}
    adapter_files = weights.peft_adapter(pairs, weight_map, rank=rank, alpha=alpha)
    peft_dir = weights.write_peft_adapter(adapter_files, work / "peft", overwrite=True)
    # 3b. The adapters folded into the base, written through the base's map.
    tokens = next(iter(rows))["inputs"][:4]
    adapted = logits_of(model, tokens)
    merged = lora.merge(nnx.clone(model))  # W + alpha/rank * A @ B; a plain GPT2 again
    merged_file = weights.save_safetensors(
        nnx.state(merged, nnx.Param), work / "merged" / "model.safetensors", weight_map,
        overwrite=True,
    )  # fmt: skip
    print(f"fine-tuning loss {losses[0]:.3f} -> {losses[-1]:.3f}; PEFT adapter in {peft_dir}, "
          f"merged weights in {merged_file}")  # fmt: skip

    # The checks: the base untouched, the adapter read back, the merged file reloaded.
    file = safetensors.numpy.load_file(str(base_file))
    if not np.array_equal(np.asarray(model.h[0].mlp.c_fc.kernel[...]), file["h.0.mlp.c_fc.weight"]):
        raise SystemExit("FAILED: a base weight changed")
    adapter = weights.read_peft_adapter(peft_dir)
    module = "transformer.h.0.attn.c_attn"  # q and v in GPT-2's fused projection
    if (
        adapter.config["r"] != rank
        or not adapter.config["fan_in_fan_out"]
        or module not in adapter.modules()
    ):
        raise SystemExit(f"FAILED: the PEFT config is not the run's: {adapter.config}")
    kernels = {path: (*a.shape[:-1], *b.shape[1:]) for path, (a, b) in pairs.items()}
    read = weights.adapter_arrays(adapter, weight_map, kernels, rank=rank, alpha=alpha)
    for path, (a, b) in pairs.items():
        if not np.allclose(read[path][0] @ read[path][1], np.asarray(a @ b), atol=1e-6):
            raise SystemExit(f"FAILED: the PEFT adapter of {path} reads back otherwise")
    plain = Trainer(lambda rngs: GPT2(config, rngs), optax.sgd(0.0), loss_fn=loss_fn,
                    init_from=weights.Pretrained(merged_file, weight_map))  # fmt: skip
    gap = float(np.abs(logits_of(plain.model, tokens) - adapted).max())  # built from the file
    if gap > 1e-4:
        raise SystemExit(f"FAILED: the merged model's logits differ from the adapted by {gap}")
    if not losses[-1] < 0.9 * losses[0]:
        raise SystemExit(f"FAILED: the fine-tuning loss did not fall ({losses})")
    print(f"OK: finetune: the loss fell, the base is the file's, the PEFT adapter reads back, "
          f"the merged file gives the adapted logits (within {gap:.1e})")  # fmt: skip
    return losses[-1]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="real sizes instead of tiny ones")
    parser.add_argument("--out", help="where the files go (default: a new temporary folder)")
    args = parser.parse_args()
    main(args.full, args.out)
