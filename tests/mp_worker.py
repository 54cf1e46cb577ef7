"""One process of a multi-process run started by the tests (``distributed.Launch``).

    python tests/mp_worker.py OUT.npz [STRATEGY ...]
    python tests/mp_worker.py OUT.npz --grain CHECKPOINTS MAX_STEPS [--rows-counted] [--auto]
    python tests/mp_worker.py OUT.npz --sequence NAME ...   (tiny GPT, SEQUENCE_STRATEGIES)
    python tests/mp_worker.py OUT.npz --pipeline NAME ...   (scanned, PIPELINE_STRATEGIES)
    python tests/mp_worker.py REPORT --a-slice-per-process   (fails: REPORT.0, REPORT.1)

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
from mp_runs import (  # noqa: E402
    AUTO,
    STRATEGIES,
    train,
    train_a_slice_per_process,
    train_gpt_sequence,
    train_grain,
)

if __name__ == "__main__":
    assert jax.process_count() == 2 and jax.local_device_count() == 4, jax.devices()
    results: dict[str, np.ndarray] = {}
    if sys.argv[2:3] == ["--a-slice-per-process"]:
        train_a_slice_per_process(Path(sys.argv[1]))  # raises
        sys.exit("the run fed against data_shard was not stopped")
    if sys.argv[2:3] == ["--grain"]:  # OUT.npz --grain CHECKPOINTS MAX_STEPS [--rows-counted]
        results = train_grain(
            Path(sys.argv[3]),
            int(sys.argv[4]),
            rows_counted="--rows-counted" in sys.argv[5:],
            strategy=AUTO if "--auto" in sys.argv[5:] else None,
        )
    elif sys.argv[2:3] == ["--sequence"]:  # OUT.npz --sequence NAME ... (SEQUENCE_STRATEGIES)
        for name in sys.argv[3:]:
            results.update(train_gpt_sequence(name))
    elif sys.argv[2:3] == ["--expert"]:  # OUT.npz --expert NAME ... (EXPERT_STRATEGIES)
        for name in sys.argv[3:]:
            results.update(train_gpt_sequence(name, expert=True))
    elif sys.argv[2:3] == ["--pipeline"]:  # OUT.npz --pipeline NAME ... (PIPELINE_STRATEGIES)
        for name in sys.argv[3:]:
            results.update(train_gpt_sequence(name, pipeline=True))
    else:
        for name in sys.argv[2:] or STRATEGIES:
            results.update(train(name))
    if jax.process_index() == 0:
        np.savez(sys.argv[1], **results)
