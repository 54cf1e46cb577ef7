"""One process of the 2-process GRPO run of test_grpo_multiprocess (``distributed.Launch``).

python tests/grpo_mp_worker.py OUT.npz
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from nnx_spmd_trainer import distributed  # noqa: E402

assert distributed.initialize(), "run me through distributed.Launch"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from grpo_mp_runs import train  # noqa: E402

if __name__ == "__main__":
    assert jax.process_count() == 2 and jax.local_device_count() == 4, jax.devices()
    results = train()
    if jax.process_index() == 0:
        np.savez(sys.argv[1], **results)
