"""ExpertParallel with 2 JAX processes x 4 simulated devices: the MoE GPT trained through
``Trainer.fit`` gives one device's per-step losses (1e-5) and parameters (1e-4), plain
optax, with the experts inside each process (rows over the processes) and with the
expert axis spanning them (the all-to-alls cross the processes)."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from mp_runs import EXPERT_STRATEGIES, STEPS, tiny_moe_gpt, token_batches
from toy_models import train_reference

from nnx_spmd_trainer import distributed
from nnx_spmd_trainer.app.models import gpt

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # make test runs these alone
WORKER = Path(__file__).parent / "mp_worker.py"


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> dict[str, np.ndarray]:
    out = tmp_path_factory.mktemp("mp-expert") / "results.npz"
    log = io.StringIO()
    command = [sys.executable, str(WORKER), str(out), "--expert", *EXPERT_STRATEGIES]
    status = distributed.Launch(command, 2, out=log).run()
    assert status == 0, log.getvalue()[-4000:]
    return dict(np.load(out))


@pytest.fixture(scope="module")
def one_device() -> tuple[dict[str, np.ndarray], list[float]]:
    params, losses = train_reference(
        tiny_moe_gpt, optax.sgd(0.5), token_batches(STEPS), loss_fn=gpt.loss_fn
    )
    flat = jax.tree_util.tree_flatten_with_path(params)[0]  # named as mp_runs.gathered names
    return {"/".join(map(str, path)): np.asarray(leaf) for path, leaf in flat}, losses


@pytest.mark.parametrize("name", list(EXPERT_STRATEGIES))
def test_experts_over_two_processes_train_the_moe_gpt_like_one_device(
    two_processes, one_device, name
):
    ref_params, ref_losses = one_device
    np.testing.assert_allclose(two_processes[f"{name}/losses"], ref_losses, rtol=1e-5, atol=1e-5)
    prefix = f"{name}/params/"
    got = {k.removeprefix(prefix): v for k, v in two_processes.items() if k.startswith(prefix)}
    assert got.keys() == ref_params.keys()
    assert any("['moe']/['wi']" in key for key in got)  # the experts were compared
    for key, want in ref_params.items():
        np.testing.assert_allclose(got[key], want, rtol=1e-4, atol=1e-5, err_msg=key)
    assert int(two_processes[f"{name}/shard"][1]) == 2  # each process feeds its own rows
