"""How long a candidate layout's step takes when trained as ``fit`` trains.

``strategy="auto"`` ranks layouts (``planner.auto.choose``); measuring one is the
engine's job, so the planner is handed ``time_steps`` (``auto.TimeSteps``) and never
imports the engine. Each step is taken as the trainer's loop takes it
(``loop.train_one``) on a ``Run`` of the candidate's own, so a layout is timed as it
will train; every array of the timing is deleted after it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import jax

from nnx_spmd_trainer.data.placement import InFlight
from nnx_spmd_trainer.data.to_host import delete_arrays
from nnx_spmd_trainer.engine.loop import train_one
from nnx_spmd_trainer.engine.run import Run
from nnx_spmd_trainer.planner.plan import Plan


def time_steps(plan: Plan, compiled: Any, batches: Sequence[Any], in_flight: int = 2) -> float:
    """Seconds per step of ``compiled`` over ``batches`` (placed on ``plan``'s mesh) from a
    fresh state of ``plan``, at most ``in_flight`` steps unfinished; then every array the
    run made is deleted (the batches are the caller's)."""
    run = Run()  # its plan brings its own metric accumulators
    run.plan = plan
    bound = InFlight(in_flight)
    try:
        with jax.set_mesh(plan.mesh):
            jax.block_until_ready((run.objects().arrays(), run.metric_log.train, batches))
            start = time.perf_counter()
            for batch in batches:
                train_one(run, compiled, batch, bound)
            bound.drain()
            jax.block_until_ready((run.objects().arrays(), run.metric_log.train))
            return (time.perf_counter() - start) / len(batches)
    finally:
        bound.clear()
        log = run.metric_log
        arrays = run.live.arrays() if run.live is not None else []
        delete_arrays((arrays, log.train, log.eval, log.norms))
