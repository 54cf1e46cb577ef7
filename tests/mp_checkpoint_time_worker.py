"""One of two processes saving checkpoints by the clock (``distributed.Launch``).

    python tests/mp_checkpoint_time_worker.py CHECKPOINTS

Trains ``Net`` (DataParallel, log points every 2 steps) to step 2, then to step 10 in a
second ``fit`` (compiled by then), process 0 sleeping 2.4 s after step 5. Process 0
saves by ``save_every_n_seconds=2``; process 1 is given 10^9 s, a clock that would never
say "save": it saves when process 0's does. Each process writes the steps it saved to
``CHECKPOINTS.saved.<process>``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from nnx_spmd_trainer import distributed  # noqa: E402

assert distributed.initialize(), "run me through distributed.Launch"

import jax  # noqa: E402
import optax  # noqa: E402
from mp_runs import local_rows  # noqa: E402
from toy_models import Net, classification_loss, make_batches  # noqa: E402

from nnx_spmd_trainer import Callback, Trainer  # noqa: E402
from nnx_spmd_trainer.callbacks import OrbaxCheckpoint  # noqa: E402


class NotedSaves(OrbaxCheckpoint):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.saved: list[int] = []

    def save(self, step: int, *, force: bool = False, local: bool = False) -> bool:
        saved = super().save(step, force=force, local=local)
        if saved:
            self.saved.append(step)
        return saved


class SleepOnFirst(Callback):
    def on_train_batch_end(self, step, logs):
        if step == 5 and jax.process_index() == 0:
            time.sleep(2.4)


if __name__ == "__main__":
    directory = Path(sys.argv[1])
    every_s = 2.0 if jax.process_index() == 0 else 1e9
    checkpoint = NotedSaves(directory, save_every_n_seconds=every_s)
    trainer = Trainer(
        Net, optax.sgd(0.1), loss_fn=classification_loss, callbacks=[checkpoint, SleepOnFirst()],
        log_every_n_steps=2, track_norms=False,
    )  # fmt: skip
    shard = trainer.placement.data_shard
    batches = [local_rows(b, *shard) for b in make_batches(10)]
    trainer.fit(batches, max_steps=2)
    trainer.fit(batches[2:], max_steps=10)
    Path(f"{directory}.saved.{jax.process_index()}").write_text(json.dumps(checkpoint.saved))
