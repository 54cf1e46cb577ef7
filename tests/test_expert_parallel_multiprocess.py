"""ExpertParallel with 2 JAX processes x 4 simulated devices: the MoE GPT trained through
``Trainer.fit`` gives one device's per-step losses (1e-5) and parameters (1e-4), plain
optax, with the experts inside each process (rows over the processes) and with the
expert axis spanning them (the all-to-alls cross the processes)."""

from __future__ import annotations

import numpy as np
import pytest
from mp_runs import EXPERT_STRATEGIES, MOE_LOGGED, launched, one_device_gpt, tiny_moe_gpt
from test_expert_parallel import recording

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # make test runs these alone


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> dict[str, np.ndarray]:
    return launched(tmp_path_factory.mktemp("mp-expert"), "--expert", *EXPERT_STRATEGIES)


@pytest.fixture(scope="module")
def one_device() -> tuple[dict[str, np.ndarray], list[float], list[dict[str, float]]]:
    seen: list[dict[str, float]] = []  # each step's MoE metrics
    return (*one_device_gpt(tiny_moe_gpt, loss_fn=recording(seen)), seen)


@pytest.mark.parametrize("name", list(EXPERT_STRATEGIES))
def test_experts_over_two_processes_train_the_moe_gpt_like_one_device(
    two_processes, one_device, name
):
    ref_params, ref_losses, ref_steps = one_device
    np.testing.assert_allclose(two_processes[f"{name}/losses"], ref_losses, rtol=1e-5, atol=1e-5)
    prefix = f"{name}/params/"
    got = {k.removeprefix(prefix): v for k, v in two_processes.items() if k.startswith(prefix)}
    assert got.keys() == ref_params.keys()
    assert any("['moe']/['wi']" in key for key in got)  # the experts were compared
    for key, want in ref_params.items():
        np.testing.assert_allclose(got[key], want, rtol=1e-4, atol=1e-5, err_msg=key)
    assert int(two_processes[f"{name}/shard"][1]) == 2  # each process feeds its own rows
    # The load-balance loss and the dropped tokens, step by step, as on one device.
    assert sum(step["moe_dropped_tokens"] for step in ref_steps) > 0  # capacity did drop
    for key in MOE_LOGGED:
        want = [step[key] for step in ref_steps]
        np.testing.assert_allclose(two_processes[f"{name}/{key}"], want, rtol=1e-5, err_msg=key)
