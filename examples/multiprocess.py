"""A multi-process run in your own script: ``distributed.initialize()`` and ``grain_pipeline``.

    python examples/multiprocess.py          # launches itself as 2 processes x 4 CPU devices
    python examples/multiprocess.py --full   # bigger model and more steps
    python examples/multiprocess.py --processes 1   # the same job in this one process

On a cluster, start this script once per host (SLURM, Open MPI, Kubernetes and
Cloud TPU are detected by JAX) or give each process
``NNX_SPMD_COORDINATOR=host:port NNX_SPMD_NUM_PROCESSES=N NNX_SPMD_PROCESS_ID=i``.
Run by hand on one machine it starts 2 copies of itself with
``distributed.Launch`` (coordinator on 127.0.0.1, 4 of the 8 simulated devices
each, output prefixed with the process index). Every process runs the same
code: ``initialize()`` joins the job (and does nothing in a single process),
the ``Trainer`` lays FSDP over the 8 devices of both processes, and each
process feeds only its rows of every global batch,
``grain_pipeline(..., trainer.placement.data_shard)``. The script checks that
the loss fell and that the processes agree on it.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from nnx_spmd_trainer import distributed  # noqa: E402  # imports jax; no device used yet


def main(full: bool = False) -> float:
    distributed.initialize()  # first, before anything uses a device

    import jax
    import numpy as np
    import optax
    from jax.experimental import multihost_utils

    from nnx_spmd_trainer import FSDP, Trainer
    from nnx_spmd_trainer.app.datasets.synthetic import make_classification
    from nnx_spmd_trainer.app.models import MLP
    from nnx_spmd_trainer.app.models.mlp import loss_fn
    from nnx_spmd_trainer.data.grain_input import grain_pipeline

    hidden, steps, global_batch = (1024, 300, 256) if full else (64, 30, 64)
    x, y = make_classification(8192, 16, 4, seed=0)  # every process sees the same source
    trainer = Trainer(
        lambda rngs: MLP(16, hidden, 4, rngs=rngs),
        optax.adam(1e-2),
        strategy=FSDP(min_size=1),  # parameters split over all devices of all processes
        loss_fn=loss_fn,
        log_every_n_steps=10,
    )
    shard = trainer.placement.data_shard  # (this process's index, processes feeding rows)
    data = grain_pipeline(
        len(x), global_batch, shard, seed=0, batch_fn=lambda i: {"inputs": x[i], "labels": y[i]}
    )
    losses = trainer.fit(data, max_steps=steps).history["train/loss"]

    every = multihost_utils.process_allgather(np.float32(losses[-1]))
    if jax.process_index() == 0:  # the others print nothing
        layout = f"{jax.process_count()} process(es), {jax.device_count()} devices"
        print(
            f"{layout}, rows {shard.index}::{shard.count}; loss {losses[0]:.4f} -> {losses[-1]:.4f}"
        )
    if not losses[-1] < losses[0] or not np.all(every == every[0]):
        raise SystemExit(f"FAILED: loss {losses}, final loss per process {every}")
    if jax.process_index() == 0:
        print(f"OK: multiprocess: the loss fell, on {jax.process_count()} process(es)")
    return losses[-1]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="real sizes instead of tiny ones")
    parser.add_argument("--processes", type=int, default=2, help="processes to launch here")
    args = parser.parse_args()
    joined = distributed.NUM_PROCESSES in os.environ  # started by a launcher, or by hand
    if args.processes > 1 and not joined:
        command = [sys.executable, os.path.abspath(__file__), *sys.argv[1:]]
        sys.exit(distributed.Launch(command, args.processes).run())
    main(args.full)
