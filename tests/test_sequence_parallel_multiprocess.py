"""SequenceParallel with 2 JAX processes x 4 simulated devices, through the public API.

The tiny GPT trained through ``Trainer.fit`` gives one device's per-step losses
(1e-5) and parameters (1e-4), plain optax, under issue 20's four layouts and
``Hybrid(DataParallel(), SequenceParallel(2))`` (the sequence inside a process),
whether the processes split the rows (each feeds its own) or the sequence
itself (``SequenceParallel(8)``, ``Hybrid(SequenceParallel(4),
TensorParallel(2))``: both processes feed the same whole rows, each device
keeping its chunk). The ``_ring`` runs take ``attention="ring"`` (issue 31): keys
and values passed round the ``seq`` axis, across the processes where it spans them.
"""

from __future__ import annotations

import numpy as np
import pytest
from mp_runs import SEQUENCE_STRATEGIES, launched, one_device_gpt, tiny_gpt

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # make test runs these alone


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> dict[str, np.ndarray]:
    return launched(tmp_path_factory.mktemp("mp-seq"), "--sequence", *SEQUENCE_STRATEGIES)


@pytest.fixture(scope="module")
def one_device() -> tuple[dict[str, np.ndarray], list[float]]:
    return one_device_gpt(tiny_gpt)


@pytest.mark.parametrize(
    ("name", "feeders"),
    [
        ("seq8", 1),
        ("fsdp2_x_seq4", 2),
        ("seq4_x_tp2", 1),
        ("dp2_x_seq2_x_tp2", 2),
        ("dp_x_seq2", 2),
        ("seq8_ring", 1),
        ("fsdp2_x_seq4_ring", 2),
        ("dp2_x_seq2_x_tp2_ring", 2),
    ],
)
def test_two_processes_train_the_gpt_like_one_device(two_processes, one_device, name, feeders):
    ref_params, ref_losses = one_device
    np.testing.assert_allclose(two_processes[f"{name}/losses"], ref_losses, rtol=1e-5, atol=1e-5)
    prefix = f"{name}/params/"
    got = {k.removeprefix(prefix): v for k, v in two_processes.items() if k.startswith(prefix)}
    assert got.keys() == ref_params.keys()
    for key, want in ref_params.items():
        np.testing.assert_allclose(got[key], want, rtol=1e-4, atol=1e-5, err_msg=key)
    # Rows split over the processes (each feeds its own), or a sequence split over them
    # (both feed the same whole rows).
    assert int(two_processes[f"{name}/shard"][1]) == feeders
