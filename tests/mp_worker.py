"""One process of a multi-process run started by the tests (``distributed.Launch``).

    python tests/mp_worker.py OUT.npz [STRATEGY ...]
    python tests/mp_worker.py OUT.npz --grain CHECKPOINTS MAX_STEPS   (grain_resume.py)

Joins the job from the launcher's variables, trains ``Net`` under every
strategy of ``STRATEGIES`` on the same global batches (this process feeding
only its rows of each, the strategy's ``data_shard``), and process 0 writes
each strategy's per-step losses and final parameters to OUT.npz.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from nnx_spmd_trainer import distributed  # noqa: E402

assert distributed.initialize(), "run me through distributed.Launch"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from toy_models import Net, RecordLosses, classification_loss, make_batches  # noqa: E402

from nnx_spmd_trainer import FSDP, DataParallel, Hybrid, TensorParallel, Trainer  # noqa: E402

STRATEGIES = {
    "dp": lambda: DataParallel(),
    "fsdp": lambda: FSDP(min_size=1),
    "fsdp_x_tp": lambda: Hybrid(FSDP(4, min_size=1), TensorParallel(2)),
    "tp8": lambda: TensorParallel(),  # the model axis spans both processes
}
STEPS = 4


def local_rows(batch: dict, index: int, count: int) -> dict:
    """This process's block of a global batch (``make_array_from_process_local_data`` order)."""
    rows = len(batch["x"]) // count
    return {k: v[index * rows : (index + 1) * rows] for k, v in batch.items()}


def train(name: str) -> dict[str, np.ndarray]:
    recorder = RecordLosses()
    trainer = Trainer(
        Net,
        optax.adam(1e-2),
        strategy=STRATEGIES[name](),
        loss_fn=classification_loss,
        callbacks=[recorder],
    )
    shard = trainer.data_shard
    trainer.fit([local_rows(b, *shard) for b in make_batches(STEPS)], max_steps=STEPS)
    params = multihost_utils.process_allgather(nnx.state(trainer.model, nnx.Param), tiled=True)
    flat = {
        f"{name}/params/" + "/".join(map(str, path)): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    return {**flat, f"{name}/losses": np.asarray(recorder.losses), f"{name}/shard": np.array(shard)}


if __name__ == "__main__":
    assert jax.process_count() == 2 and jax.local_device_count() == 4, jax.devices()
    results: dict[str, np.ndarray] = {}
    if sys.argv[2:3] == ["--grain"]:  # OUT.npz --grain CHECKPOINTS MAX_STEPS
        from grain_resume import train_grain

        results = train_grain(Path(sys.argv[3]), int(sys.argv[4]))
    else:
        for name in sys.argv[2:] or STRATEGIES:
            results.update(train(name))
    if jax.process_index() == 0:
        np.savez(sys.argv[1], **results)
