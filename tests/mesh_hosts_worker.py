"""One process of test_mesh_hosts's run (2 processes of 4 devices, ``distributed.Launch``).

    python tests/mesh_hosts_worker.py OUT.npz

For each layout of ``TRAINED``: ``Net`` trained 4 steps, this process feeding its
``data_shard`` rows; its losses, the shard, the process of each mesh device, the
batch's spec and the compiled train step's HLO text. For ``COMPILED_ONLY``: the HLO
text alone (a plan, no state built). For ``WARNED``: the warnings ``make_mesh`` gave.
Process 0 writes them all to OUT.npz.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from nnx_spmd_trainer import distributed  # noqa: E402

assert distributed.initialize(), "run me through distributed.Launch"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from mp_runs import STEPS, local_rows  # noqa: E402
from toy_models import Net, RecordLosses, classification_loss, make_batches  # noqa: E402

from nnx_spmd_trainer import (  # noqa: E402
    FSDP,
    DataParallel,
    Hybrid,
    Plan,
    SequenceParallel,
    TensorParallel,
    Trainer,
)

TRAINED = {
    "tp2_fsdp4": lambda: Hybrid(TensorParallel(2), FSDP(4, min_size=1)),
    # The data axis listed last: still across the processes, the batch fed in blocks.
    "fsdp4_dp2": lambda: Hybrid(FSDP(4, min_size=1), DataParallel(2)),
}
COMPILED_ONLY = {  # the tensor axis placed across the processes on purpose
    "tp2_fsdp4_model_across": lambda: Hybrid(
        TensorParallel(2), FSDP(4, min_size=1), across_hosts={"model": 2}
    ),
}
WARNED = {
    "tp8": lambda: TensorParallel(8),  # cannot fit in a process of 4 devices
    "seq8": lambda: SequenceParallel(8),
    "tp2_fsdp4": TRAINED["tp2_fsdp4"],
    "fsdp8": lambda: FSDP(8),  # fsdp spanning hosts is usual: no warning
    "tp8_said": lambda: Hybrid(TensorParallel(8), across_hosts={"model": 2}),
}


def layout(mesh: jax.sharding.Mesh) -> dict[str, np.ndarray]:
    return {
        "axes": np.array(mesh.axis_names),
        "process_ids": np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices),
    }


def hlo(plan: Plan) -> str:
    return plan.lower(make_batches(1)[0]).compile().as_text()


def trained(name: str) -> dict[str, np.ndarray]:
    recorder = RecordLosses()
    trainer = Trainer(
        Net,
        optax.adam(1e-2),
        strategy=TRAINED[name](),
        loss_fn=classification_loss,
        callbacks=[recorder],
    )
    shard = trainer.placement.data_shard
    trainer.fit([local_rows(b, *shard) for b in make_batches(STEPS)], max_steps=STEPS)
    spec = trainer.plan.batch_shardings(make_batches(1)[0])["x"].spec
    return {
        "losses": np.asarray(recorder.losses),
        "shard": np.array(shard),
        "batch_spec": np.array(repr(spec)),
        "hlo": np.array(hlo(trainer.plan)),
        **layout(trainer.mesh),
    }


def compiled_only(name: str) -> dict[str, np.ndarray]:
    plan = Plan(Net, optax.adam(1e-2), strategy=COMPILED_ONLY[name](), loss_fn=classification_loss)
    return {"hlo": np.array(hlo(plan)), **layout(plan.mesh)}


def warned(name: str) -> dict[str, np.ndarray]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mesh = WARNED[name]().make_mesh()
    return {"warnings": np.array([str(w.message) for w in caught], dtype=str), **layout(mesh)}


if __name__ == "__main__":
    assert jax.process_count() == 2 and jax.local_device_count() == 4, jax.devices()
    results: dict[str, np.ndarray] = {}
    for runs, run in ((TRAINED, trained), (COMPILED_ONLY, compiled_only), (WARNED, warned)):
        for name in runs:
            results.update({f"{run.__name__}/{name}/{k}": v for k, v in run(name).items()})
    if jax.process_index() == 0:
        np.savez(sys.argv[1], **results)
