"""GRPO as two JAX processes (4 simulated devices each, Gloo) trains as one process of 8:
the same sampled completions, rewards and advantages (bitwise), the same losses and
final weights (float tolerance: the gradient's sum across processes adds in another
order), while each process scores only the rows it feeds. The processes feed their
prompts interleaved (``rows[index::count]``, as the CLI does), so the placed batch is a
permutation of the one-process batch: the sampler's rows, in prompt order, are not."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import numpy as np
import pytest
from grpo_mp_runs import GROUP, PROMPTS, ROLLOUTS, train

from nnx_spmd_trainer import distributed

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # make test runs these alone
WORKER = Path(__file__).parent / "grpo_mp_worker.py"


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> dict[str, np.ndarray]:
    out = tmp_path_factory.mktemp("grpo-mp") / "results.npz"
    log = io.StringIO()
    status = distributed.Launch([sys.executable, str(WORKER), str(out)], 2, out=log).run()
    assert status == 0, log.getvalue()[-4000:]
    return dict(np.load(out))


@pytest.fixture(scope="module")
def one_process() -> dict[str, np.ndarray]:
    return train()


def by_rows(rollout: dict[str, np.ndarray], i: int) -> np.ndarray:
    """Rollout ``i``'s rows (tokens, weights, reward, advantage), sorted: the order inside
    a global batch depends on how the processes feed it; the rows do not."""
    keys = ("inputs", "weights", "rewards", "advantages")
    columns = [rollout[f"rollout/{i}/{k}"].reshape(GROUP * PROMPTS, -1) for k in keys]
    rows = np.concatenate([c.astype(np.float64) for c in columns], axis=1)
    return rows[np.lexsort(rows.T[::-1])]


def test_two_processes_sample_and_reward_as_one_process(two_processes, one_process):
    for i in range(ROLLOUTS):
        np.testing.assert_array_equal(by_rows(two_processes, i), by_rows(one_process, i))
    np.testing.assert_array_equal(two_processes["reward"], one_process["reward"])
    assert np.abs(one_process["rollout/0/advantages"]).max() > 0.5  # rewards that differ
    # Each process's reward function saw its own half of each rollout, not the whole.
    assert one_process["reward_calls"].tolist() == [GROUP * PROMPTS] * ROLLOUTS
    assert two_processes["reward_calls"].tolist() == [GROUP * PROMPTS // 2] * ROLLOUTS


def test_two_processes_train_as_one_process(two_processes, one_process):
    np.testing.assert_allclose(two_processes["losses"], one_process["losses"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(two_processes["kl"], one_process["kl"], rtol=0, atol=1e-6)
    assert one_process["losses"][-1] != 0  # the second rollout's first update moved weights
    params = [k for k in one_process if k.startswith("params/")]
    assert params
    for key in params:
        np.testing.assert_allclose(
            two_processes[key], one_process[key], rtol=0, atol=1e-6, err_msg=key
        )
