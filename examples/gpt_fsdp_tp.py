"""GPT pretraining with FSDP x tensor parallelism, checkpoints and TensorBoard, then a resume.

    python examples/gpt_fsdp_tp.py          # tiny: 2 x 30 steps on 8 simulated CPU devices
    python examples/gpt_fsdp_tp.py --full   # the default job's GPT size, 2 x 150 steps
    python examples/gpt_fsdp_tp.py --workdir runs/gpt   # keep the checkpoints and logs

A character-level GPT learns the text of CPython's ``pydoc_data.topics``. The
state is laid out ``Hybrid(FSDP(4), TensorParallel(2))``: parameters and
optimizer state split 4 ways along one mesh axis and each layer split 2 ways
(Megatron style) along the other. A first ``Trainer`` trains half the steps,
saving with ``OrbaxCheckpoint``; a second, new ``Trainer`` (as after a crash or
a preemption) restores the last checkpoint, at the exact next batch, and
trains to the end. ``tensorboard --logdir <workdir>/tb`` shows both halves as
one run. The script checks that the second run resumed where the first
stopped and that the loss fell (the training loss, averaged between log
points; ``--full`` also evaluates the held-out text).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import optax  # noqa: E402

from nnx_spmd_trainer import FSDP, Hybrid, TensorParallel, Trainer  # noqa: E402
from nnx_spmd_trainer.app.datasets.text import char_lm_splits  # noqa: E402
from nnx_spmd_trainer.app.models import GPT  # noqa: E402
from nnx_spmd_trainer.app.models.gpt import loss_fn  # noqa: E402  # next-token cross entropy
from nnx_spmd_trainer.callbacks import MetricsLogger, OrbaxCheckpoint, TensorBoard  # noqa: E402


def make_trainer(vocab_size: int, full: bool, workdir: Path) -> tuple[Trainer, OrbaxCheckpoint]:
    width, layers, seq_len = (128, 2, 64) if full else (32, 1, 32)
    every = 50 if full else 10  # log interval; a checkpoint every other one (and at fit's end)
    checkpoint = OrbaxCheckpoint(workdir / "checkpoints", save_every_n_steps=2 * every)
    trainer = Trainer(
        lambda rngs: GPT(
            vocab_size=vocab_size,
            seq_len=seq_len,
            embed_dim=width,
            num_heads=4,
            ff_dim=4 * width,
            num_layers=layers,
            dropout_rate=0.0,
            rngs=rngs,
        ),
        optax.adamw(3e-3 if full else 1e-2),
        strategy=Hybrid(FSDP(4), TensorParallel(2)),
        loss_fn=loss_fn,
        callbacks=[MetricsLogger(log_every_n_steps=every), TensorBoard(workdir / "tb"), checkpoint],
    )
    return trainer, checkpoint


def main(full: bool = False, workdir: str | None = None) -> float:
    if workdir is None:  # a fresh directory, removed at the end (an old one holds a finished run)
        with tempfile.TemporaryDirectory(prefix="gpt_fsdp_tp-") as fresh:
            return main(full, fresh)
    steps = 300 if full else 60
    work = Path(workdir)
    tokenizer, splits = char_lm_splits(
        seq_len=64 if full else 32, batch_size=32 if full else 16, seed=0, max_eval_batches=4
    )

    # The first run: half the steps, checkpointed as it goes.
    first, _ = make_trainer(tokenizer.vocab_size, full, work)
    first.fit(splits.train, max_steps=steps // 2)
    start = first.history.history["train/loss"][0]  # the average over the first log interval
    print(f"first run stopped at step {first.step}; saved in {work / 'checkpoints'}")

    # A new trainer, as a new process would build it: fit restores the latest checkpoint.
    second, checkpoint = make_trainer(tokenizer.vocab_size, full, work)
    history = second.fit(splits.train, splits.eval if full else None, max_steps=steps)
    end = history.history["train/loss"][-1]
    print(f"second run restored step {checkpoint.restored_step}, ended at step {second.step}")
    print(f"training loss {start:.3f} -> {end:.3f} (unigram baseline {splits.baseline:.3f})")
    if full:
        print(f"held-out loss {history.history['eval/loss'][-1]:.3f}")

    if checkpoint.restored_step != steps // 2 or second.step != steps:
        raise SystemExit(f"FAILED: resumed at {checkpoint.restored_step}, ended {second.step}")
    if not end < start:
        raise SystemExit(f"FAILED: the loss did not fall ({start} -> {end})")
    print("OK: gpt_fsdp_tp: resumed from the checkpoint and the loss fell")
    return end


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="real sizes instead of tiny ones")
    parser.add_argument(
        "--workdir",
        help="a new directory to keep the checkpoints and logs in (default: a temporary one)",
    )
    args = parser.parse_args()
    main(args.full, args.workdir)
