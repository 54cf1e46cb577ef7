"""One of two processes saving in two tiers, crashing, and resuming (``distributed.Launch``).

    python tests/mp_checkpoint_tiers_worker.py ROOT

Trains ``Net`` (DataParallel over both processes' devices) to step 10 three times, each
process writing ``ROOT.<process>.json``:

1. with ``ROOT/persistent`` every 4 steps and ``ROOT/local`` every 3, failing after
   step 7 (an exception in both processes: the saves in flight complete, step 7 is not
   saved): persistent 4, local 3 and 6 are left;
2. again with the same checkpoints: it resumes from the newest step of either tier,
   local 6, and trains steps 7 to 10;
3. uninterrupted, without checkpoints: the losses run 2 must repeat.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from nnx_spmd_trainer import distributed  # noqa: E402

assert distributed.initialize(), "run me through distributed.Launch"

import jax  # noqa: E402
import optax  # noqa: E402
from mp_runs import local_rows  # noqa: E402
from toy_models import Net, RecordLosses, classification_loss, make_batches  # noqa: E402

from nnx_spmd_trainer import Callback, Trainer  # noqa: E402
from nnx_spmd_trainer.callbacks import OrbaxCheckpoint  # noqa: E402

STEPS = 10


class Crash(Callback):
    def on_train_batch_end(self, step, logs):
        if step == 7:
            raise RuntimeError("simulated crash")


def run(callbacks: list[Callback]) -> RecordLosses:
    losses = RecordLosses()
    trainer = Trainer(
        Net, optax.sgd(0.1), loss_fn=classification_loss, callbacks=[*callbacks, losses],
        log_every_n_steps=1, track_norms=False,
    )  # fmt: skip
    shard = trainer.placement.data_shard
    trainer.fit([local_rows(b, *shard) for b in make_batches(STEPS)], max_steps=STEPS)
    return losses


def two_tiers(root: Path) -> OrbaxCheckpoint:
    return OrbaxCheckpoint(
        root / "persistent", save_every_n_steps=4,
        local_directory=root / "local", local_every_n_steps=3,
    )  # fmt: skip


if __name__ == "__main__":
    root = Path(sys.argv[1])
    crashed = two_tiers(root)
    try:
        run([crashed, Crash()])
    except RuntimeError as error:
        assert "simulated crash" in str(error), error
    left = {"persistent": crashed.steps(), "local": crashed.local_steps()}
    resumed = two_tiers(root)
    after = run([resumed])
    whole = run([])
    Path(f"{root}.{jax.process_index()}.json").write_text(json.dumps({
        "left": left, "restored": resumed.restored_step, "after": after.losses,
        "whole": whole.losses, "persistent": resumed.steps(), "local": resumed.local_steps(),
    }))  # fmt: skip
